"""Offline analysis of a profiler window: trace reading, op costs, roofline, suggestions, ``mfuwatch analyze``.

Levels, each importing only the ones above it: :mod:`.trace` (streaming chrome-trace reader and
index) and :mod:`.opcost` (FLOPs and bytes of one aten op from its recorded shapes); :mod:`.roofline`
(classifies each activity against the machine balance of :class:`mfuwatch.agent.device.peaks.Peaks`, the
time breakdown); :mod:`.suggest` (matches the remedies registry, expected gains); :mod:`.analyze`
(:func:`~.analyze.analyze_events`, the pipeline the live profiler's child process and the command
line share, and ``mfuwatch analyze``). Nothing here imports torch or the live agent.
"""
