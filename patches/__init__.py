"""The monkey-patches of transformers that have no extension point (installed as ``dustin_hf.patches``)."""
