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

# before_checkout COMMIT: a copy of COMMIT's tree at /tmp/tierspec-before-COMMIT, to run beside this checkout
# (its C engine must be this checkout's: the build is copied, not made); prints the folder.
before_checkout() {
    local folder=/tmp/tierspec-before-$1
    if ! ls "$folder"/tierspec/_qengine*.so > /dev/null 2>&1; then
        rm -rf "$folder" && mkdir -p "$folder" && git archive "$1" | tar -x -C "$folder" && cp tierspec/*.so "$folder/tierspec/"
    fi
    echo "$folder"
}

# before_own_build COMMIT: as before_checkout, but COMMIT's extensions built from its own sources in the folder
# (/tmp/tierspec-before-COMMIT-own), for a commit whose extensions' interface differs from this checkout's; prints it.
before_own_build() {
    local folder=/tmp/tierspec-before-$1-own
    if ! ls "$folder"/tierspec/_keyed_noise*.so > /dev/null 2>&1; then
        rm -rf "$folder" && mkdir -p "$folder" && git archive "$1" | tar -x -C "$folder"
        (cd "$folder" && python setup.py build_ext --inplace -q > /dev/null 2>&1)
    fi
    echo "$folder"
}
