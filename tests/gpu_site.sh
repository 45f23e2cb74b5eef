# Sourced by the device jobs (tests/gpu_suite.sh, benchmarks/gpu_runs.sh,
# benchmarks/train_variants.sh): installs the carried wheel folders (tests/gpu_wheels.sh)
# into one site folder and puts it, and the repo, on PYTHONPATH.
#   install_wheels SITE FOLDER...   folders that are missing are skipped; a site already
#                                   holding the same folders' wheels is kept (a job run
#                                   again on a warm machine does not reinstall)
install_wheels() {
  local site=$1 files=() d; shift
  for d in "$@"; do [ -d "$d" ] && files+=("$d"/*.whl); done
  [ ${#files[@]} -gt 0 ] || return 0
  if [ "$(cat "$site/.installed" 2>/dev/null)" != "$*" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" "${files[@]}" || return 1
    echo "$*" > "$site/.installed"
  fi
  export PYTHONPATH=$site:$PWD PYTHONUNBUFFERED=1
}
