"""Seconds: the roofline over every kernel the exact simulator traces (roofline), its per-GPU
efficiencies (calibration, with the shipped calibrations/), FlashAttention's IO (attention_io), the
MFU conventions in use (mfu), whole training runs (training_run) and sweeps of memory and time (sweep).

May import: memcalc.model, memcalc.memory, memcalc.exact, memcalc.errors, memcalc.terms.
"""
