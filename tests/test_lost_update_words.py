"""Issue 46, item 7: the lost-update sentence names the variant once and leads with the largest share ("bf16-pure:
…, bf16-pure: 0% of updates lost at step 1 (… the most, 20%, at step 4)" repeated the name and led with 0%)."""

from __future__ import annotations

import pandas as pd

from nbtrain import verdicts as V
from nbtrain.engine import doctor


def test_the_verdict_names_the_variant_once_and_leads_with_the_largest_share():
    by_step = {1: 0.0, 2: 0.1, 3: 0.15, 4: 0.2}
    lrs = {k: 1e-3 for k in by_step}
    line = doctor.lost_updates_line("bf16-pure", by_step, False, lrs)
    h = pd.DataFrame({"step": [1, 2, 3, 4], "loss": [5.0, 4.9, 4.8, 4.7], "lr": [1e-3] * 4})
    v = V.verdict("bf16-pure", "fp32", h, h, {"lost_updates": 0.11}, lost_updates_text=line)
    assert v.text.startswith("bf16-pure: ") and v.text.count("bf16-pure") == 1
    said = v.text[v.text.index("of updates lost") - len("20% "):]
    assert said.startswith("20% of updates lost at step 4 (where lr is 0.001), the most of sampled steps 1, 2, 3, 4 "
                           "(0% at step 1)")
