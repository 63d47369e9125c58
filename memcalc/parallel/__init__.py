"""Beyond one GPU: layouts over TP, SP, PP, VPP, CP, DP and EP with ZeRO and offload (layout), the
engines that lay them out (engines), the links and collectives (links), expert parallel's traffic
(experts), the step time of a layout (comm), and the planner that searches every layout (plan).

May import: memcalc.model, memcalc.memory, memcalc.exact, memcalc.time, memcalc.errors, memcalc.terms.
"""
