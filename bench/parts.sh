# Sourced by the bench scripts that run several measured parts in one device call (bench/run_all.sh,
# bench/features.sh): each part under its own time limit, cut to what is left before $DEADLINE_S (counted
# from $started), its output in $WORK/NAME.log, so a slow or hung part costs its own figure only.
# shellcheck shell=bash
elapsed() { echo "[$(( $(date +%s) - started )) s] $*"; }

# part NAME SECONDS COMMAND...: run COMMAND for at most SECONDS, fewer when the deadline is nearer (leaving
# 10 s for the summary); skipped when under 20 s are left.
part() {
  local name=$1 limit=$2; shift 2
  local left=$(( DEADLINE_S - 10 - ($(date +%s) - started) ))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 20 ]; then elapsed "$name SKIPPED: out of time"; echo "skipped: out of time" >"$WORK/$name.log"; return; fi
  elapsed "$name: up to $limit s"
  timeout --signal=TERM --kill-after=10 "$limit" "$@" >"$WORK/$name.log" 2>&1
  local code=$?
  if [ "$code" = 124 ] || [ "$code" = 137 ]; then elapsed "$name STOPPED at its $limit s limit"; tail -5 "$WORK/$name.log"
  elif [ "$code" != 0 ]; then elapsed "$name FAILED (exit $code)"; tail -20 "$WORK/$name.log"
  else elapsed "$name done"; fi
}

# wheels PY: the device image lacks omegaconf (and trl, datasets): install the carried wheel folders
# .whl and .whl-trl into /tmp/site_parts when they are there and the import fails.
wheels() {
  local py=$1 folder
  for folder in .whl .whl-trl; do
    if [ -d "$folder" ] && ! $py -c "import omegaconf, trl, datasets" 2>/dev/null; then
      $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_parts "$folder"/*.whl \
        && export PYTHONPATH=$PYTHONPATH:/tmp/site_parts
    fi
  done
}
