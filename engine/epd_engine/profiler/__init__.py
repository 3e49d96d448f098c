"""Trace-replay profiler: cost model, discrete-event simulator (drives ``scheduler/``), plan search.

Imports no torch: only ``profile.py`` (``epdctl profile-costs``) loads it, lazily.
"""
