"""Calibration: the search for scoring heads and ``draft_share`` (:mod:`.search`), and the quick one run on the
prompt itself (:mod:`.prompt`). The decode loop never imports it; :mod:`dustin_hf.adapter.assisted` hands it in."""
