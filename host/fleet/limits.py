"""The coordinator's stated numbers, in a module without imports so `poet --help` can quote them cheaply."""

MIB = 1024 * 1024
MAX_MESSAGE_BYTES = 8 * MIB  # gRPC messages, both directions; a model travels in MODEL_CHUNK_BYTES chunks
MODEL_CHUNK_BYTES = 1 * MIB
MAX_MODEL_BYTES = 4 * 1024 * MIB  # an archive an operator uploads (`poet run --model module:callable`)
HEARTBEAT_INTERVAL_S = 2.0
HEARTBEAT_TIMEOUT_S = 10.0  # an agent not seen for this long is listed as offline (5 missed heartbeats)
MAX_PULL_WAIT_S = 30.0  # the longest a PullJob long poll is held open
AUTO_MARGIN_BYTES = 8 * MIB  # `--ram-budget auto`: headroom for allocator slack and the agent's own buffers
SOLVE_TIME_LIMIT_S = 60.0  # per distinct schedule; the best schedule found by then is used, with its gap
SOLVE_LEASE_S = 30.0  # a solver worker's claim on a solve; renewed every third of it while it solves
SOLVE_IDLE_POLL_S = 1.0  # an idle solver worker looks for solves queued by other processes this often
DEFAULT_SOLVER_WORKERS = 1  # `poet serve --solver-workers`: solves at once (each HiGHS solve uses its own process)
MAX_WORKERS = 64  # server threads: each long poll and each telemetry stream holds one while open
STOP_GRACE_S = 5.0  # on shutdown, calls in flight get this long to finish
DEFAULT_STATE_DIR = "poet-state"
CALIBRATION_MODELS = ("mlp", "resnet18_cifar")  # `poet calibrate` default models
CALIBRATION_STEPS = 40  # steps per calibration run: 20 fitted, 19 held out after the warm-up step (20 left the
# medians of tiny steps to a few disturbed ones: bench/calibration.py --as-user)
CALIBRATION_BATCH_SIZE = 8
# runs of each calibration schedule, in rounds (every schedule once, then again): a slow spell of a board that shares
# its machine slows one run of each schedule, not all runs of one; their held-out steps are pooled
CALIBRATION_REPEATS = 3
# What a board may send (host/fleet/validation.py): larger or odder values are refused at the door
MAX_FACT_BYTES = 1 << 50  # a byte count a board reports (RAM, flash, limits): 1 PiB
MAX_CPU_COUNT = 4096
MAX_FACT_CHARS = 256  # platform, torch and agent versions, board, each meter name
MAX_METERS = 16
MAX_DATASETS = 256  # datasets a board reports at Register
MAX_SAMPLE_DIMS = 8  # dimensions of a dataset's sample shape
MAX_SAMPLE_DIM = 1 << 31  # one dimension's size, a dataset's classes
MAX_ERROR_CHARS = 4096  # a result's error line; longer ones are cut, saying how much was cut
MAX_EVENTS_PER_RUN = 1 << 40  # a result's events_emitted
# What one board may hold open at once (host/fleet/admission.py); over a limit: RESOURCE_EXHAUSTED
MAX_CALLS_PER_NODE = 8  # all its calls together: one board holds at most an eighth of MAX_WORKERS
MAX_STREAMS_PER_NODE = 2  # telemetry streams
MAX_DOWNLOADS_PER_NODE = 2  # model downloads
# Server threads no board call may take, so the operator's calls and health checks always find one: all boards
# together hold at most MAX_WORKERS - OPERATOR_RESERVED_WORKERS calls
OPERATOR_RESERVED_WORKERS = 8
DOWNLOAD_IDLE_S = 60.0  # a model download whose chunks nobody reads for this long is cancelled
MAX_EVENTS_PER_BATCH = 5000  # telemetry events in one batch (agents send up to 4000)
MAX_EVENT_BYTES = 16 * 1024  # one telemetry event, serialized
MAX_SEQ = (1 << 63) - 1  # a telemetry sequence number (SQLite's INTEGER)
LIST_PAGE_SIZE = 500  # entries per page of `ListAgents` / `ListRuns` when the caller asks for no size
MAX_LIST_PAGE_SIZE = 5000
LIST_PAGE_BYTES = 4 * MIB  # a page ends before this many bytes of entries (half the message limit)
