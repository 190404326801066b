#!/usr/bin/env bash
# Packs the workers-scaling bench for a machine without tito's dependencies and without internet.
#
# Run here, from anywhere in the repository: it writes .gpu/tito/ (git-ignored), holding the wheels of
# every package tito and the bench need beyond what that machine has (python3.12 with torch, numpy,
# jinja2, httpx, uvloop, h11), at the versions of this workspace's lock, for x86_64 and aarch64, and
# run.sh. There, from the repository root, `bash .gpu/tito/run.sh` installs the wheels into a folder of
# its own (pip --no-index --no-deps --target) and runs bench/tito_throughput.py with the engine stand-in
# for `tito serve --workers 1,2,4,8,16`, in under a minute, each row appended to "$OUT/tito_scaling.txt"
# as it is measured (a run cut short keeps what it measured).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
bundle=.gpu/tito
rm -rf "$bundle"
mkdir -p "$bundle/wheels"

# name==version of each package in the closure of tito's requirements (its pyproject's) and uvicorn's
# httptools (which it uses when installed), less what the target machine has, and less pillow (images
# only) and hf-xet (downloads only), which the bench never imports.
uv run --no-sync python - >"$bundle/requirements.txt" <<'EOF'
import importlib.metadata as metadata
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

there = set(
    "torch numpy jinja2 markupsafe httpx httpcore anyio certifi idna sniffio h11 uvloop filelock fsspec "
    "networkx sympy mpmath typing-extensions setuptools triton pillow hf-xet".split()
)
with open("packages/tito/pyproject.toml", "rb") as file:
    todo = [Requirement(line).name for line in tomllib.load(file)["project"]["dependencies"]]
todo, found = [*todo, "httptools"], {}
while todo:
    name = canonicalize_name(todo.pop())
    if name in found or name in there or name.startswith("nvidia-"):
        continue
    found[name] = metadata.version(name)
    for line in metadata.requires(name) or ():
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            todo.append(requirement.name)
print("\n".join(f"{name}=={version}" for name, version in sorted(found.items())))
EOF

download() {  # $1: machine (x86_64 | aarch64), $2: folder; the rest: requirements
  local machine=$1 folder=$2
  shift 2
  python3 -m pip download --quiet --no-deps --only-binary=:all: --dest "$folder" \
    --implementation cp --python-version 3.12 --abi cp312 --abi abi3 --abi none \
    --platform "manylinux_2_28_$machine" --platform "manylinux_2_17_$machine" \
    --platform "manylinux2014_$machine" --platform any "$@"
}
download x86_64 "$bundle/wheels" -r "$bundle/requirements.txt"
mkdir -p "$bundle/wheels/x86_64" "$bundle/wheels/aarch64"
binary=()
for wheel in "$bundle"/wheels/*.whl; do
  case "$wheel" in
    *-none-any.whl) ;;
    *)
      mv "$wheel" "$bundle/wheels/x86_64/"
      binary+=("$(basename "$wheel" | cut -d- -f1 | tr _ -)")
      ;;
  esac
done
for name in "${binary[@]}"; do
  download aarch64 "$bundle/wheels/aarch64" "$(grep -i "^$name==" "$bundle/requirements.txt")"
done

cat >"$bundle/run.sh" <<'EOF'
#!/usr/bin/env bash
# From the repository root: bash .gpu/tito/run.sh   (written by bench/tito_scaling_bundle.sh)
set -uo pipefail
out=${OUT:-/tmp/tito-scaling}
mkdir -p "$out"
report="$out/tito_scaling.txt"
site=$(mktemp -d /tmp/tito-site-XXXX)
{
  echo "# tito --workers scaling, engine stand-in; $(date -u +%FT%TZ); $(uname -m); $(nproc) cores; $(uptime)"
  began=$(date +%s)
  wheels=(.gpu/tito/wheels/*.whl .gpu/tito/wheels/"$(uname -m)"/*.whl)
  if python3 -m pip --version >/dev/null 2>&1; then
    python3 -m pip install --quiet --no-index --no-deps --no-compile --target "$site" "${wheels[@]}" 2>&1 | tail -5
  else  # a wheel is a zip of what goes into site-packages
    for wheel in "${wheels[@]}"; do python3 -m zipfile -e "$wheel" "$site"; done
  fi
  echo "# wheels installed in $(($(date +%s) - began)) s"
} >"$report"
export PYTHONPATH="$site:$PWD/packages/tito/src:$PWD/packages/molt/src" HF_HUB_OFFLINE=1
python3 -c 'import torch, transformers; print("# torch", torch.__version__, "transformers", transformers.__version__)' \
  >>"$report" 2>>"$out/tito_scaling.log"
# Rows of 1 + 2.5 s; every server starts at once before the first row (about 15 s on 16 cores).
python3 -u bench/tito_throughput.py --no-vllm --workers "${TITO_WORKERS:-1,2,4,8,16}" --warmup 1 --seconds 2.5 --engines 2 \
  2>>"$out/tito_scaling.log" | tee -a "$report"
echo "# done in $(($(date +%s) - began)) s after the install began" >>"$report"
EOF
chmod +x "$bundle/run.sh"
du -sh "$bundle"
echo "wrote $bundle: run there, from the repository root: bash $bundle/run.sh"
