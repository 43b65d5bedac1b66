"""Prediction: the TTFT and decode models fitted to what the engines measured.

* :mod:`.decode` — The decode side of a prediction, learned from identified tokens: TPOT against the
  running batch, output lengths, and what is left of a running ...
* :mod:`.ttft` — TTFT projection for predictive admission, fitted to measured data.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from narwhal_serve.exports import lazy_exports

# the package's public names (what the rest of Narwhal uses), each with the module that defines it:
# imported on first use, so importing the package imports none of them (narwhal_serve/exports.py)
_EXPORTS = {
    "DEFAULT_OUTPUT_PRIOR": "decode",
    "ErrorWindow": "ttft",
    "IDLE_ERRORS_MIN": "ttft",
    "Gram": "ttft",
    "OutputLengths": "decode",
    "PRIOR_A": "ttft",
    "PRIOR_B": "ttft",
    "PRIOR_TPOT_A": "decode",
    "RELEASES_MAX": "ttft",
    "PrefillModel": "ttft",
    "Projection": "ttft",
    "TpotModel": "decode",
    "decoding_requests": "ttft",
    "expected_output": "decode",
    "fit_prefill": "ttft",
    "linear_ttft": "ttft",
    "mean_remaining": "decode",
    "on_idle_engine": "ttft",
    "project_linear": "ttft",
    "projected_pair": "ttft",
    "released_wait_s": "ttft",
    "remaining_tokens": "decode",
    "slot_releases": "ttft",
    "slot_wait_s": "ttft",
    "tpot_at": "decode",
    "with_margin": "ttft",
}
__all__ = [
    "DEFAULT_OUTPUT_PRIOR", "ErrorWindow", "Gram", "IDLE_ERRORS_MIN", "OutputLengths", "PRIOR_A", "PRIOR_B",
    "PRIOR_TPOT_A", "RELEASES_MAX", "PrefillModel", "Projection", "TpotModel", "decoding_requests", "expected_output",
    "fit_prefill", "linear_ttft", "mean_remaining", "on_idle_engine", "project_linear", "projected_pair", "released_wait_s",
    "remaining_tokens", "slot_releases", "slot_wait_s", "tpot_at", "with_margin",
]
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)

if TYPE_CHECKING:
    from narwhal_serve.prediction.decode import DEFAULT_OUTPUT_PRIOR as DEFAULT_OUTPUT_PRIOR
    from narwhal_serve.prediction.ttft import ErrorWindow as ErrorWindow
    from narwhal_serve.prediction.ttft import Gram as Gram
    from narwhal_serve.prediction.ttft import IDLE_ERRORS_MIN as IDLE_ERRORS_MIN
    from narwhal_serve.prediction.decode import OutputLengths as OutputLengths
    from narwhal_serve.prediction.ttft import PRIOR_A as PRIOR_A
    from narwhal_serve.prediction.ttft import PRIOR_B as PRIOR_B
    from narwhal_serve.prediction.decode import PRIOR_TPOT_A as PRIOR_TPOT_A
    from narwhal_serve.prediction.ttft import PrefillModel as PrefillModel
    from narwhal_serve.prediction.ttft import RELEASES_MAX as RELEASES_MAX
    from narwhal_serve.prediction.ttft import Projection as Projection
    from narwhal_serve.prediction.decode import TpotModel as TpotModel
    from narwhal_serve.prediction.ttft import decoding_requests as decoding_requests
    from narwhal_serve.prediction.decode import expected_output as expected_output
    from narwhal_serve.prediction.ttft import fit_prefill as fit_prefill
    from narwhal_serve.prediction.ttft import linear_ttft as linear_ttft
    from narwhal_serve.prediction.decode import mean_remaining as mean_remaining
    from narwhal_serve.prediction.ttft import on_idle_engine as on_idle_engine
    from narwhal_serve.prediction.ttft import project_linear as project_linear
    from narwhal_serve.prediction.ttft import projected_pair as projected_pair
    from narwhal_serve.prediction.ttft import released_wait_s as released_wait_s
    from narwhal_serve.prediction.decode import remaining_tokens as remaining_tokens
    from narwhal_serve.prediction.ttft import slot_releases as slot_releases
    from narwhal_serve.prediction.ttft import slot_wait_s as slot_wait_s
    from narwhal_serve.prediction.decode import tpot_at as tpot_at
    from narwhal_serve.prediction.ttft import with_margin as with_margin
