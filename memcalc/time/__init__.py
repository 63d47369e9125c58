"""Seconds: the roofline over every kernel the exact simulator traces (roofline), one GPU of a parallel
layout on it, stage part by stage part (stages), its per-GPU efficiencies (calibration, with the shipped
calibrations/), FlashAttention's IO (attention_io), a mixture of experts' GEMMs (experts), the MFU
conventions in use (mfu), whole training runs (training_run) and sweeps of memory and time (sweep).

May import: memcalc.model, memcalc.memory, memcalc.exact, memcalc.errors, memcalc.terms.
"""
