"""Prediction: the TTFT and decode models fitted to what the engines measured.

* :mod:`.decode` — The decode side of a prediction, learned from identified tokens: TPOT against the
  running batch, output lengths, and what is left of a running ...
* :mod:`.ttft` — TTFT projection for predictive admission, fitted to measured data.
"""
