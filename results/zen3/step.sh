# The campaign scripts' step: run a command under the exclusive CPU lock, its output to $out/NAME.log,
# skipped when $out/NAME.done marks it done (resumable). Sourced by the run*.sh scripts after they set $out
# (from the repository root); it makes $out and puts this checkout first on PYTHONPATH, whatever the
# editable install points at.
step() {
    local name=$1; shift
    if [ -e "$out/$name.done" ]; then echo "skip $name"; return; fi
    echo "=== $name $(date -u +%FT%TZ): $*"
    if flock -x /tmp/tierspec-cpu.lock "$@" > "$out/$name.log" 2>&1; then touch "$out/$name.done"; echo "ok $name $(date -u +%FT%TZ)";
    else echo "FAILED $name (rc $?) $(date -u +%FT%TZ)"; tail -5 "$out/$name.log"; fi
}
mkdir -p "$out"
export PYTHONPATH="$PWD"
