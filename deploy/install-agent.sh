#!/usr/bin/env bash
# Install the poet-edge device agent on a board (Raspberry Pi OS, JetPack/Ubuntu, any systemd Linux).
#
#   sudo ./install-agent.sh --wheel poet_edge-0.1.0-py3-none-any.whl --certs ./pi-01 \
#        --coordinator coordinator.lan:50051 [--memory-max 1500M]
#
# What it does, each step safe to repeat (re-running upgrades the wheel and rewrites the config):
#   1. a virtual environment PREFIX/opt/poet-agent/venv, with --system-site-packages when the system
#      python already imports torch (keeps the board's own torch, e.g. NVIDIA's Jetson wheel);
#   2. the wheel installed into it WITHOUT extras (no solver, no plotting, no cryptography);
#   3. the service user (default poet, a system user; when run as root), added to the video, i2c
#      and gpio groups where they exist (CUDA on a Jetson, INA2xx power monitors);
#   4. the certificate bundle (ca.pem, cert.pem, key.pem) copied to PREFIX/etc/poet-agent/certs,
#      key.pem 0600 and owned by the service user when run as root;
#   5. the EnvironmentFile PREFIX/etc/poet-agent/agent.env with the coordinator and the directories;
#   6. the unit PREFIX/etc/systemd/system/poet-agent.service (+ drop-ins paths.conf, memory.conf),
#      then `systemctl enable` and (re)start -- skipped with --no-systemd, without systemctl, when
#      not root, or with a --prefix other than /, saying so.
# Every path is under --prefix (default /), so the script can be tried against a scratch directory.
set -euo pipefail

PROG=${0##*/}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

die() { printf '%s: error: %s\n' "$PROG" "$*" >&2; exit 2; }
say() { printf '%s: %s\n' "$PROG" "$*"; }

usage() {
    cat <<EOF
usage: $PROG --wheel FILE --certs BUNDLE_DIR --coordinator HOST:PORT [options]

required:
  --wheel FILE            the poet_edge-*.whl to install (built with: python -m pip wheel --no-deps -w dist .)
  --certs BUNDLE_DIR      this node's bundle from \`poet certs issue --node NAME\` (ca.pem, cert.pem, key.pem)
  --coordinator HOST:PORT the coordinator the agent dials ([IPv6]:PORT for IPv6)

options:
  --prefix DIR            install under DIR instead of / (default /)
  --flash-dir DIR         where activations are paged out (default /var/lib/poet-agent/flash)
  --data-dir DIR          the board's local datasets (default /var/lib/poet-agent/data)
  --state-dir DIR         telemetry buffer, checkpoints, trained weights (default /var/lib/poet-agent)
  --memory-max SIZE       the agent's RAM budget as systemd MemoryMax= (e.g. 1500M, 2G, 60%)
  --platform NAME         pass --platform NAME to the agent (kept from the last run when omitted)
  --user NAME             the service user (default poet; created when missing and run as root)
  --python PATH           the python that creates the venv (default python3)
  --pip-args "ARGS"       extra pip arguments, e.g. "--no-deps" or "--no-index --find-links DIR"
                          for offline installs (also read from \$POET_PIP_ARGS)
  --no-systemd            write the files but do not enable or start the unit
  -h, --help              this help
EOF
}

WHEEL="" CERTS="" COORDINATOR="" PREFIX="/" MEMORY_MAX="" PLATFORM="" NO_SYSTEMD=0
FLASH_DIR=/var/lib/poet-agent/flash DATA_DIR=/var/lib/poet-agent/data STATE_DIR=/var/lib/poet-agent
SERVICE_USER=poet PYTHON=python3 PIP_ARGS=${POET_PIP_ARGS:-}

need_value() { [[ $# -ge 2 && -n $2 ]] || die "$1 needs a value (see --help)"; }
while [[ $# -gt 0 ]]; do
    case $1 in
        --wheel) need_value "$@"; WHEEL=$2; shift 2 ;;
        --certs) need_value "$@"; CERTS=$2; shift 2 ;;
        --coordinator) need_value "$@"; COORDINATOR=$2; shift 2 ;;
        --prefix) need_value "$@"; PREFIX=$2; shift 2 ;;
        --flash-dir) need_value "$@"; FLASH_DIR=$2; shift 2 ;;
        --data-dir) need_value "$@"; DATA_DIR=$2; shift 2 ;;
        --state-dir) need_value "$@"; STATE_DIR=$2; shift 2 ;;
        --memory-max) need_value "$@"; MEMORY_MAX=$2; shift 2 ;;
        --platform) need_value "$@"; PLATFORM=$2; shift 2 ;;
        --user) need_value "$@"; SERVICE_USER=$2; shift 2 ;;
        --python) need_value "$@"; PYTHON=$2; shift 2 ;;
        --pip-args) [[ $# -ge 2 ]] || die "--pip-args needs a value"; PIP_ARGS=$2; shift 2 ;;
        --no-systemd) NO_SYSTEMD=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown argument: $1 (see --help)" ;;
    esac
done

# ---- check every input before touching anything -------------------------------------------------
[[ -n $WHEEL ]] || die "--wheel FILE is required (see --help)"
[[ -n $CERTS ]] || die "--certs BUNDLE_DIR is required (see --help)"
[[ -n $COORDINATOR ]] || die "--coordinator HOST:PORT is required (see --help)"

[[ $WHEEL != *\[* ]] || die "--wheel takes the file only: the agent is installed without extras"
[[ -f $WHEEL ]] || die "wheel not found: $WHEEL"
[[ $WHEEL == *.whl ]] || die "not a wheel (expected a .whl file): $WHEEL"

[[ -d $CERTS ]] || die "certificate bundle not found: $CERTS (make one with: poet certs issue --dir DIR --node NAME)"
for f in ca.pem cert.pem key.pem; do
    [[ -f $CERTS/$f ]] || die "certificate bundle $CERTS lacks $f (expected ca.pem, cert.pem, key.pem from \`poet certs issue\`)"
    [[ -r $CERTS/$f ]] || die "cannot read $CERTS/$f (run as root?)"
done

# HOST:PORT, HOST a name or IPv4 address, or [IPv6]:PORT; PORT 1-65535.
if [[ $COORDINATOR =~ ^\[([0-9A-Fa-f:.]+)\]:([0-9]+)$ ]] || [[ $COORDINATOR =~ ^([A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?):([0-9]+)$ ]]; then
    port=${BASH_REMATCH[${#BASH_REMATCH[@]}-1]}
    if [[ ${#port} -gt 5 ]] || (( 10#$port < 1 || 10#$port > 65535 )); then
        die "bad --coordinator '$COORDINATOR': port must be 1-65535"
    fi
else
    die "bad --coordinator '$COORDINATOR': expected HOST:PORT (e.g. coordinator.lan:50051, 10.0.0.5:50051, [fd00::5]:50051)"
fi

if [[ -n $MEMORY_MAX ]]; then
    [[ $MEMORY_MAX =~ ^([0-9]+[KMGT]?|[0-9]+(\.[0-9]+)?%|infinity)$ ]] \
        || die "bad --memory-max '$MEMORY_MAX': expected bytes with an optional K/M/G/T suffix (1500M, 2G), a percentage (60%) or infinity"
fi
for d in "$FLASH_DIR" "$DATA_DIR" "$STATE_DIR"; do
    [[ $d == /* ]] || die "directories must be absolute paths: $d"
    [[ $d != *[[:space:]]* ]] || die "directories may not contain spaces: $d"
done
[[ $PREFIX == /* ]] || die "--prefix must be an absolute path: $PREFIX"
[[ $PLATFORM =~ ^[A-Za-z0-9._-]*$ ]] || die "bad --platform '$PLATFORM'"
command -v "$PYTHON" >/dev/null 2>&1 || die "python not found: $PYTHON (install python3, or pass --python PATH)"
UNIT_SRC=$HERE/poet-agent.service
[[ -f $UNIT_SRC ]] || die "unit file not found next to this script: $UNIT_SRC (copy the whole deploy/ directory)"

# ---- where everything goes -------------------------------------------------------------------------
ROOT=${PREFIX%/}                      # "" for /
VENV=$ROOT/opt/poet-agent/venv
ETC=$ROOT/etc/poet-agent
CERTS_DST=$ETC/certs
ENV_FILE=$ETC/agent.env
UNIT_DIR=$ROOT/etc/systemd/system
UNIT=$UNIT_DIR/poet-agent.service
DROPIN=$UNIT_DIR/poet-agent.service.d
FLASH_DIR=$ROOT$FLASH_DIR DATA_DIR=$ROOT$DATA_DIR STATE_DIR=$ROOT$STATE_DIR

IS_ROOT=0; [[ $(id -u) -eq 0 ]] && IS_ROOT=1

# ---- 1. the virtual environment -------------------------------------------------------------------
SYSTEM_SITE=0
if torch_version=$("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null); then
    SYSTEM_SITE=1
    say "the system python has torch $torch_version: the venv reuses it (--system-site-packages)"
else
    say "no torch in the system python: pip installs one into the venv"
fi
if [[ ! -x $VENV/bin/python ]]; then
    say "creating the virtual environment $VENV"
    mkdir -p "$(dirname "$VENV")"
    venv_flags=(); [[ $SYSTEM_SITE -eq 1 ]] && venv_flags+=(--system-site-packages)
    "$PYTHON" -m venv "${venv_flags[@]}" "$VENV" \
        || die "could not create the venv (on Debian/Ubuntu/Raspberry Pi OS: sudo apt-get install python3-venv)"
else
    say "virtual environment $VENV exists; reusing it"
    want=false; [[ $SYSTEM_SITE -eq 1 ]] && want=true
    sed -i "s/^include-system-site-packages *=.*/include-system-site-packages = $want/" "$VENV/pyvenv.cfg"
fi

# ---- 2. the wheel, without extras ----------------------------------------------------------------
pip_args=(); [[ -n $PIP_ARGS ]] && read -r -a pip_args <<<"$PIP_ARGS"
say "installing $(basename "$WHEEL") (no extras)${PIP_ARGS:+ with pip args: $PIP_ARGS}"
# The wheel itself is always reinstalled (a rebuilt wheel of the same version replaces the old);
# its dependencies only when missing, so the board's torch is kept.
"$VENV/bin/python" -m pip install --disable-pip-version-check --no-input --quiet \
    --force-reinstall --no-deps "${pip_args[@]}" "$WHEEL" || die "pip could not install $WHEEL"
"$VENV/bin/python" -m pip install --disable-pip-version-check --no-input --quiet \
    "${pip_args[@]}" "$WHEEL" || die "pip could not install the dependencies of $WHEEL (offline? try --pip-args)"
[[ -x $VENV/bin/poet-agent ]] || die "the wheel installed no poet-agent command: $VENV/bin/poet-agent"

# ---- 3. the service user ---------------------------------------------------------------------------
OWNER=""
if [[ $IS_ROOT -eq 1 ]]; then
    if ! id "$SERVICE_USER" >/dev/null 2>&1; then
        say "creating the system user $SERVICE_USER"
        useradd --system --user-group --home-dir "$STATE_DIR" --no-create-home \
            --shell /usr/sbin/nologin "$SERVICE_USER" || die "could not create the user $SERVICE_USER"
    fi
    if [[ $SERVICE_USER != "$(id -un)" ]]; then     # never change the groups of the installing account
        for g in video i2c gpio render; do
            if getent group "$g" >/dev/null && ! id -nG "$SERVICE_USER" | tr ' ' '\n' | grep -qx "$g"; then
                usermod -aG "$g" "$SERVICE_USER" && say "added $SERVICE_USER to the group $g"
            fi
        done
    fi
    SERVICE_GROUP=$(id -gn "$SERVICE_USER")
    OWNER=$SERVICE_USER:$SERVICE_GROUP
else
    SERVICE_GROUP=$SERVICE_USER
    say "not root: files stay owned by $(id -un); no user is created"
fi

# ---- directories ---------------------------------------------------------------------------------
for d in "$STATE_DIR" "$FLASH_DIR" "$DATA_DIR"; do
    mkdir -p "$d"
    chmod 0750 "$d"
    [[ -n $OWNER ]] && chown "$OWNER" "$d"
done

# ---- 4. the certificates ---------------------------------------------------------------------------
mkdir -p "$CERTS_DST"
chmod 0750 "$CERTS_DST"
if [[ $(cd "$CERTS" && pwd -P) != $(cd "$CERTS_DST" && pwd -P) ]]; then
    install -m 0644 "$CERTS/ca.pem" "$CERTS_DST/ca.pem"
    install -m 0644 "$CERTS/cert.pem" "$CERTS_DST/cert.pem"
    install -m 0600 "$CERTS/key.pem" "$CERTS_DST/key.pem"
fi
chmod 0600 "$CERTS_DST/key.pem"
if [[ -n $OWNER ]]; then
    chown root:"${OWNER#*:}" "$ETC" "$CERTS_DST"
    chown "$OWNER" "$CERTS_DST/ca.pem" "$CERTS_DST/cert.pem" "$CERTS_DST/key.pem"
fi
say "certificates placed in $CERTS_DST (key.pem 0600${OWNER:+, owned by $SERVICE_USER})"

# ---- 5. the EnvironmentFile ----------------------------------------------------------------------
agent_args=""
if [[ -n $PLATFORM ]]; then
    agent_args="--platform $PLATFORM"
elif [[ -f $ENV_FILE ]]; then                    # keep what the operator set last time
    agent_args=$(sed -n 's/^POET_AGENT_ARGS=//p' "$ENV_FILE" | tail -n 1)
fi
tmp=$(mktemp "$ETC/.agent.env.XXXXXX")
cat >"$tmp" <<EOF
# poet-agent's settings, read by poet-agent.service (EnvironmentFile=). Written by install-agent.sh;
# re-run it, or edit this file and run: systemctl restart poet-agent
POET_COORDINATOR=$COORDINATOR
POET_CERTS=$CERTS_DST
POET_FLASH_DIR=$FLASH_DIR
POET_DATA_DIR=$DATA_DIR
POET_STATE_DIR=$STATE_DIR
# Extra flags for \`poet-agent run\`, e.g. --platform a72 --memory-limit 1500000000
POET_AGENT_ARGS=$agent_args
EOF
chmod 0640 "$tmp"
[[ -n $OWNER ]] && chown root:"${OWNER#*:}" "$tmp"
mv -f "$tmp" "$ENV_FILE"
say "wrote $ENV_FILE"

# ---- 6. the unit and its drop-ins ----------------------------------------------------------------
mkdir -p "$UNIT_DIR" "$DROPIN"
sed -e "s#/opt/poet-agent/venv#$VENV#g" -e "s#/etc/poet-agent/agent.env#$ENV_FILE#g" \
    -e "s#^User=poet\$#User=$SERVICE_USER#" -e "s#^Group=poet\$#Group=$SERVICE_GROUP#" \
    "$UNIT_SRC" >"$UNIT.tmp"
mv -f "$UNIT.tmp" "$UNIT"
chmod 0644 "$UNIT"
cat >"$DROPIN/paths.conf.tmp" <<EOF
# Written by install-agent.sh: the agent's directories, writable under ProtectSystem=strict.
[Service]
ReadWritePaths=-$STATE_DIR -$FLASH_DIR -$DATA_DIR
EOF
mv -f "$DROPIN/paths.conf.tmp" "$DROPIN/paths.conf"
if [[ -n $MEMORY_MAX ]]; then
    cat >"$DROPIN/memory.conf.tmp" <<EOF
# Written by install-agent.sh --memory-max: the agent's RAM budget. The agent reads its cgroup's
# memory.max and reports it, so the coordinator solves a schedule that fits under it.
[Service]
MemoryMax=$MEMORY_MAX
EOF
    mv -f "$DROPIN/memory.conf.tmp" "$DROPIN/memory.conf"
    say "RAM budget: MemoryMax=$MEMORY_MAX ($DROPIN/memory.conf)"
fi
chmod 0644 "$DROPIN"/*.conf
say "wrote $UNIT"

if [[ $NO_SYSTEMD -eq 1 ]]; then
    say "skipping systemd (--no-systemd): the unit is not enabled or started"
elif ! command -v systemctl >/dev/null 2>&1; then
    say "skipping systemd: systemctl not found; start the agent yourself with $VENV/bin/poet-agent run ... (see $ENV_FILE)"
elif [[ -n $ROOT ]]; then
    say "skipping systemd: --prefix $PREFIX is not /; systemd reads /etc/systemd/system (link the unit with: systemctl link $UNIT)"
elif [[ $IS_ROOT -eq 0 ]]; then
    say "skipping systemd: not root; run: sudo systemctl daemon-reload && sudo systemctl enable --now poet-agent"
else
    systemctl daemon-reload
    systemctl enable poet-agent.service
    systemctl restart poet-agent.service
    say "poet-agent enabled and (re)started; follow it with: journalctl -u poet-agent -f"
fi
say "done: $VENV/bin/poet-agent dials $COORDINATOR"
