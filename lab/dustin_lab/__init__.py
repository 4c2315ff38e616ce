"""The lab: the ``dustin-hf`` command, the demo, offline calibration over books, fidelity evaluation (walks,
needle, oracle, estimators, the quality knob), traces, plotting, offline model fetching and the bundled texts.

A project of its own beside the library (``lab/pyproject.toml``), so ``pip install dustin-hf`` installs none of
it. It imports only the library's public names (those in a module's ``__all__``), and nothing in the library
imports it: ``tests/test_layers.py`` checks both.
"""
