"""A Panel Compare on SmolLM2-135M-Instruct as a person clicks it (issue 46.2): LoRA, fp32 / fp16 / bf16, N steps,
one repeat, the buttons pressed from code. Prints every new status line with the seconds since the process
started (the click comes after the imports), then the Compare's wall time and its verdicts.

    python benchmarks/panel_compare.py 20 > benchmarks/results/panel_compare_cpu_<date>.txt
"""

import html
import re
import sys
import time

T0 = time.perf_counter()

from nbtrain.ui.panel import Panel  # noqa: E402 - the clock starts before the imports, as a notebook's does


def main(steps: int = 20) -> None:
    panel = Panel(debounce_s=0)
    last = [None]

    def seen(change):
        line = html.unescape(re.sub(r"<[^>]+>", "", change["new"]))
        key = re.sub(r"step \d+/\d+.*", "step", line)   # one line per phase, and each run's first step
        if key != last[0] or re.search(r"step 1/", line):
            print(round(time.perf_counter() - T0, 1), line[:170], flush=True)
        last[0] = key

    panel.status.observe(seen, names="value")
    panel.config = panel.config.replace(model="smollm2-135m-instruct", method="lora", max_steps=steps)
    for name, box in panel.compare_choices.items():
        box.value = name in ("fp32", "fp16", "bf16")
    t = time.perf_counter()
    panel.compare_button.click()
    panel.wait(3000)
    print("compare wall", round(time.perf_counter() - t, 1), "total", round(time.perf_counter() - T0, 1))
    print(re.sub(r"<[^>]+>", " ", panel.verdicts.value))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
