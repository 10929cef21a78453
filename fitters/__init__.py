"""kvhit fitters: the seed formulas as pure functions and the online scipy fitters.

This is the bottom layer of kvhit (see STYLE in the design card): it imports nothing from
``exporter``. Its input is :class:`fitters.observation.Observation` (what one step measured, in
MODEL.md's own terms); its outputs are :class:`fitters.result.FitResult` objects and plain floats.
"""
