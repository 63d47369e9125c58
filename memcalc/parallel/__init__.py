"""Beyond one GPU: layouts over TP, SP, PP, VPP, CP and DP with ZeRO and offload (layout), the
collectives and links that time them (comm), and the planner that searches every layout (plan).

May import: memcalc.model, memcalc.memory, memcalc.exact, memcalc.time, memcalc.errors, memcalc.terms.
"""
