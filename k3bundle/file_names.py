"""The names of the files k3bundle reads and writes in a checkpoint and in a bundle.

Each name has one owner, here, so that a writer and its readers cannot drift apart: ``convert``
writes the manifest that ``verify``, ``golden``, ``validate`` and ``checklist`` look for,
``golden`` writes the goldens ``validate`` reads, ``validate`` and ``kernels`` write the reports
``checklist`` ticks from. Paths are relative to the checkpoint or bundle directory, ``/``-separated.
This module imports nothing, so that every unit of the architecture map may use it.
"""

# --- a source checkpoint (``config.json`` is also copied, byte-identical, into every bundle) ---
CONFIG = "config.json"
SOURCE_INDEX = "model.safetensors.index.json"
SOURCE_RECORD = "source.json"  # written by ``pull`` beside what it pulled: provenance and hashes

# --- a bundle as ``convert`` writes it; the manifest last, so a bundle without it is incomplete ---
MANIFEST = "manifest.json"
WEIGHTS_INDEX = "weights.index.json"
GRAPH_MANIFEST = "graph_manifest.json"
DEVICE_DIR = "device_weights"
LAYOUT = f"{DEVICE_DIR}/layout.yaml"
CONVERT_JOURNAL = ".k3bundle-convert.journal"  # present only while a conversion is unfinished

# --- written into a bundle later by other commands; not listed in convert's manifest ---
VALIDATION_DIR = "validation"  # ``golden`` writes here by default, ``validate`` reads
GOLDEN_INPUTS = "golden_inputs.npz"
GOLDEN_INTERMEDIATES = "golden_intermediates.npz"
GOLDEN_TOLERANCES = "tolerances.yaml"  # the tolerance set the goldens were made with, copied
GOLDEN_FILES = (GOLDEN_INPUTS, GOLDEN_INTERMEDIATES, GOLDEN_TOLERANCES)

# --- optional entries of a device dump (``validate --dumps DIR``: DIR/CASE.safetensors): a runtime's
# own serving paths, each judged against the same dump's uninterrupted run (docs/dump-format.md
# "Serving paths"). ``serving.PATH.TAP`` is TAP (any tap the dump may carry, ``step_logits``,
# ``decode.…``) as the runtime computed it along PATH ---
DUMP_SERVING_PREFIX = "serving"
DUMP_SERVING_PATHS = ("resume_chunk", "resume_turn", "handoff", "batching")
DUMP_SERVING_RESUMES = ("resume_chunk", "resume_turn")
DUMP_SERVING_AT = "at"  # serving.RESUME.at: int64 [1], the prompt tokens restored from the prefix cache
DUMP_BATCH_LENGTHS = "lengths"  # serving.batching.lengths: int64 [B], every prompt length of the batch


def validate_run_marker(run_key: str) -> str:
    """``validate``, before it judges: the run of this run key judging these goldens now; its
    sign-off names the same run (``bundle.signoff``). Beside the goldens rather than in reports/,
    so that a reports/ folder that cannot be written cannot keep an earlier sign-off ticking
    either. One marker per run key, so that runs of different keys never unbind each other."""
    return f"{VALIDATION_DIR}/.k3bundle-validate.{run_key}.run"


REPORTS_DIR = "reports"
SIGNOFF_NAME = "signoff.json"  # ``validate``: the sign-off, beside .md and .html of the same stem
SIGNOFF_NAMES = (SIGNOFF_NAME, "signoff.md", "signoff.html")
# ``validate`` into a bundle keeps one folder of sign-off reports per run key (what was validated:
# ``bundle.signoff.run_key``), so that a built-in, a dumps and a backend run keep their own.
SIGNOFF_RUNS_DIR = f"{REPORTS_DIR}/validate"
# ``{"run_key": ...}``: the run that wrote its reports last, replaced atomically after they are written
SIGNOFF_LATEST = f"{SIGNOFF_RUNS_DIR}/latest.json"


def signoff_run_dir(run_key: str) -> str:
    """The folder of the sign-off reports of run key ``run_key``: ``reports/validate/KEY``."""
    return f"{SIGNOFF_RUNS_DIR}/{run_key}"


def signoff_path(run_key: str) -> str:
    """``reports/validate/KEY/signoff.json``."""
    return f"{signoff_run_dir(run_key)}/{SIGNOFF_NAME}"


KERNELS_STEM = "kernels"  # ``kernels --out BUNDLE/reports``: kernels.md, .json, .html
KERNELS_REPORT = f"{REPORTS_DIR}/{KERNELS_STEM}.json"
PERFORMANCE_REPORT = f"{REPORTS_DIR}/performance.json"  # the bring-up team's evidence (docs/bring-up.md)
FAULTS_REPORT = f"{REPORTS_DIR}/faults.json"
SOAK_REPORT = f"{REPORTS_DIR}/soak.json"
CHECKLIST = f"{REPORTS_DIR}/checklist.md"  # beside checklist.json and checklist.html

LATER_DIRS = (VALIDATION_DIR, REPORTS_DIR)
