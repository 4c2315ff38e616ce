"""The research kit: offline calibration, fidelity evaluation, model fetching, traces and the ``dustin-hf`` CLI.

It imports the library (``dustin_hf``) and nothing in the library imports it.
"""
