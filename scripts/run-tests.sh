#!/usr/bin/env bash
# Run every test of `make test`: each C unit-test binary in its own process
# with a timeout, then the Python checks (pytest in the project's venv).
# Ends with the line "N passed, N failed, N skipped" (C checks + Python
# tests). Every temporary file of the run (pytest's tmp_path, the tests'
# mkdtemp sockets, the daemons' files) goes under one directory
# /tmp/moedt-run-XXXXXX ($TMPDIR for the run), removed at the end.
set -u
BUILD=${BUILD:-build}
VENV=${VENV:-.venv}
TIMEOUT=${TEST_TIMEOUT:-600}
passed=0
failed=0
skipped=0
failed_names=()
run_tmp=$(mktemp -d "${TMPDIR:-/tmp}/moedt-run-XXXXXX")
chmod 755 "$run_tmp"
cleanup() {
    # daemons the tests left running are killed by pytest's fixtures; a
    # socket or model file left here goes with the directory
    rm -rf "$run_tmp"
}
trap cleanup EXIT
export TMPDIR="$run_tmp"

for t in "$BUILD"/tests/test_*; do
    [ -x "$t" ] || continue
    name=$(basename "$t")
    out=$(CK_DEFAULT_TIMEOUT=120 timeout "$TIMEOUT" "$t" 2>&1)
    rc=$?
    echo "$out" | grep -E '^[0-9]+%: Checks|:[EF]:' || true
    line=$(echo "$out" | grep -E '^[0-9]+%: Checks: ' | tail -1)
    if [ -n "$line" ]; then
        n=$(echo "$line" | sed -E 's/.*Checks: ([0-9]+).*/\1/')
        f=$(echo "$line" | sed -E 's/.*Failures: ([0-9]+).*/\1/')
        e=$(echo "$line" | sed -E 's/.*Errors: ([0-9]+).*/\1/')
        passed=$((passed + n - f - e))
        failed=$((failed + f + e))
        [ $((f + e)) -gt 0 ] && failed_names+=("$name")
    else
        echo "$out" | tail -20
        echo "$name: no Check summary (exit $rc)"
        failed=$((failed + 1))
        failed_names+=("$name")
    fi
    if [ $rc -ne 0 ] && [ -n "$line" ] && ! echo "${failed_names[*]:-}" | grep -qw "$name"; then
        echo "$name: exit $rc"
        failed=$((failed + 1))
        failed_names+=("$name")
    fi
done

if [ -d tests/py ]; then
    xml="$run_tmp/junit.xml"
    MOED_BUILD="$BUILD" timeout 3000 "$VENV/bin/python" -m pytest -q -rs -p no:cacheprovider \
        --basetemp="$run_tmp/pytest" --junitxml="$xml" tests/py
    rc=$?
    if [ -s "$xml" ]; then
        read -r pt pf psk < <("$VENV/bin/python" - "$xml" <<'PY'
import sys, xml.etree.ElementTree as ET
r = ET.parse(sys.argv[1]).getroot()
suites = [r] if r.tag == "testsuite" else list(r)
t = sum(int(s.get("tests", 0)) for s in suites)
f = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
sk = sum(int(s.get("skipped", 0)) for s in suites)
print(t - f - sk, f, sk)
PY
)
        passed=$((passed + pt))
        failed=$((failed + pf))
        skipped=$((skipped + psk))
        [ "$pf" -gt 0 ] && failed_names+=("pytest")
    else
        failed=$((failed + 1)); failed_names+=("pytest(rc=$rc)")
    fi
fi

[ ${#failed_names[@]} -gt 0 ] && echo "failed: ${failed_names[*]}"
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
