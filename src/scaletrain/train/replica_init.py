"""The starting weights of a fault-tolerant replica run started from Hugging Face weights (`scaletrain train
--init-from DIR` with parallel.replicas > 1; docs/fault_tolerance.md).

`scaletrain replay` recomputes a replica run in one process from its start, so the start must be in the run folder
and the same in every group: the launcher imports DIR's weights once, in one process (the replay's own model, tp = pp
= 1: interop/hf.py maps them to our parameter names), and writes them as a plain checkpoint of step 0,
`OUT/replicas/init/step_00000000` (the portable format, COMPLETE marker, its meta naming DIR). Every rank of every
group then reads that checkpoint into its own layout through the reshard path (train/resume.py `load_engine`: each
its slice), group 0 hands its name to the lighthouse, the membership log's first row has `init_from` (DIR) and
`start_checkpoint` (the folder, relative to OUT), and the replay starts from it. The folder is beside the run's
`checkpoints/`, so `train.keep_checkpoints` never prunes it. A group restarted inside the run still heals from a live
group; a whole-job resume still starts from the newest checkpoint in `checkpoints/`.
"""

from __future__ import annotations

from pathlib import Path

from scaletrain.errors import CheckpointError
from scaletrain.train import announce, resume
from scaletrain.train import checkpoint as ckpt
from scaletrain.train.checkpoint_dirs import step_dir
from scaletrain.train.trainer import Trainer

INIT_ROOT = Path("replicas") / "init"  # under OUT: the folder of the start checkpoint (one, of step 0)


def start_checkpoint(out: Path) -> Path | None:
    """The complete start checkpoint that the launcher wrote into `out` (None when the run did not start from
    imported weights)."""
    found = step_dir(out / INIT_ROOT, 0)
    return found if (found / ckpt.COMPLETE).exists() else None


def write_start(t: Trainer, hf_dir: Path, out: Path) -> Path:
    """Import `hf_dir`'s weights into `t`, the replay's one-process trainer of the run (GroupModel(cfg, replay=True),
    train/runners/replicas.py), and write them as the run's start checkpoint (step 0, no optimizer state); its
    folder."""
    from scaletrain.interop.hf import read_hf_weights
    from scaletrain.interop.hf_config import read_hf_config
    from scaletrain.train import state as st

    weights = read_hf_weights(hf_dir, t.cfg.model)
    st.load_model_tensors(t.engine, weights)
    announce.initialised(hf_dir, str(read_hf_config(hf_dir).get("model_type", "?")), weights)
    meta = resume.checkpoint_meta(t.cfg, 1, resume.trainer_meta(t))
    meta["init_from"] = str(hf_dir.resolve())
    ckpt.Saver(out / INIT_ROOT, 0, keep=1).save(0, resume.save_entries(t.engine, {t.rng_stream: t.rng}), meta)
    found = start_checkpoint(out)
    if found is None:
        raise CheckpointError(f"the start checkpoint of {hf_dir}'s weights was not written into {out / INIT_ROOT}")
    return found


def start_record(out: Path, found: Path) -> dict[str, str]:
    """What the membership log's first row says about the start: the imported directory and the checkpoint."""
    return {"init_from": str(ckpt.read_meta(found).get("init_from", "?")),
            "start_checkpoint": str(found.relative_to(out))}
