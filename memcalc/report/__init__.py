"""Result objects as people read them: every number formatted in units, laid out as Sections and rendered
as tables, Markdown, CSV or JSON by render; one module per result (estimate, explain for its --explain, fit,
mfu, sweep, roofline, layout, verify, timeline, rollout for the RL engine's phases; schema for estimate's
JSON; reference for presets, GPUs and formats; plot for the sweep's PNG, timeline_plot for the timeline's PNG
and SVG; snapshot and trace_events for the timeline as PyTorch's memory snapshot and as a Perfetto trace; files
for where they are written).

May import: the engine and memcalc.verification; never memcalc.cli, typer or rich.
"""
