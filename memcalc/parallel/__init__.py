"""Beyond one GPU: one GPU of a layout over TP, SP, PP, VPP, CP, DP and EP with ZeRO and offload (the Layout
record is memcalc.model.layout's): what a model demands of a layout (checks), the split of layers into
pipeline stages and the schedule (pipeline), the parameters and model state on one GPU (params), one
layer's activations (activations), transient buffers and logits (buffers), one GPU's memory per stage
(stage_memory), the engines that lay them out (engines), the links and collectives (links), expert
parallel's traffic (experts), the data-parallel and offload traffic (data_parallel), the step time of a
layout (comm), one TP rank's layer op by op (tp_layer), the verdict of a layout (verdict), the layouts a
job can run on (search), and the planner that ranks them (plan).

May import: memcalc.model, memcalc.memory, memcalc.exact, memcalc.time, memcalc.errors, memcalc.terms.
"""
