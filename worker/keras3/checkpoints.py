"""Checkpoints under Keras 3: the chief's BackupAndRestore at each epoch end, which every process restores from
(all must find the same epoch), and the notice (SIGTERM), taken at the first epoch end after it: every process
learns of it there (one small collective per epoch), and all stop with the chief's backup of that epoch."""

from __future__ import annotations

import json
import os
from typing import Any, Callable

from worker.training.checkpoints import Preempted, backed_up, keep_spare, keeps_backup, notice, owner_after, spare_folder
from worker.training.entrypoint import WorkerError
from worker.keras3.group import Group, alone
from worker.host.startpoint import BACKUPS
from worker.training.lines import say

BACKUP = BACKUPS[1]  # the backup's folder in the checkpoint folder (tf_keras's: worker.tensorflow.checkpoints.TF_BACKUP)


# Any (here and below): Keras 3's module and objects, which have no types
def checkpoint_callbacks(keras: Any, group: Group, checkpoint_dir: str, epochs: int,
                         on_notice: Callable[[], object]) -> list[Any]:
    """[backup, stopper]: the first and the last callback of `fit`."""

    spare = spare_folder(checkpoint_dir)

    class Backup(keras.callbacks.BackupAndRestore):  # type: ignore[misc]  # Keras has no types
        def __init__(self) -> None:
            super().__init__(backup_dir=os.path.join(checkpoint_dir, BACKUP),
                             delete_checkpoint=group.chief and not keeps_backup())

        def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
            super().on_train_begin(logs)  # every process reads the chief's backup
            epoch = self.model._initial_epoch or 0
            seen = group.gather(epoch)
            if len(set(seen)) > 1:
                raise WorkerError(f"the tasks found backups of different epochs to resume from ({seen}, in task "
                                  f"order; checkpoint dir here: {checkpoint_dir}): put --checkpoint-dir on storage "
                                  "that every host shares, or delete the backup to start over")

        def _save_model(self) -> None:
            """The chief alone writes the backup (the weights are the same on every process), each file whole: a
            kill in the middle leaves the last backup as it was; a task that keeps a spare copy writes it alike."""
            steps = int(self.params.get("steps") or 0)
            if group.chief:
                self._write(self.backup_dir)
                backed_up(checkpoint_dir, self._current_epoch, 0, steps)  # at epoch ends
            elif spare is not None:
                keep_spare(spare, lambda stage: self._write(os.path.join(stage, BACKUP)),
                           owner_after(self._current_epoch, 0, steps))

        def _write(self, folder: str) -> None:
            os.makedirs(folder, exist_ok=True)
            final = os.path.join(folder, os.path.basename(self._weights_path))
            weights = f"{final}.partial.weights.h5"  # Keras wants the suffix
            with alone(keras):
                self.model.save_weights(filepath=weights, overwrite=True)
            metadata = os.path.join(folder, os.path.basename(self._training_metadata_path))
            with open(f"{metadata}.partial", "w", encoding="utf-8") as f:
                json.dump({"epoch": self._current_epoch, "batch": self._last_batch_seen}, f)
            # weights first: a kill between the two renames resumes this epoch's weights one epoch early,
            # never an epoch later than its weights
            os.replace(weights, final)
            os.replace(f"{metadata}.partial", metadata)

    class Stopper(keras.callbacks.Callback):  # type: ignore[misc]  # Keras has no types
        said = False

        def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
            if notice.is_set() and not self.said:
                self.said = True
                on_notice()  # progress.json says "preempting": the supervisor's preempt_grace runs
                say("notice (SIGTERM): stopping with every task at the end of this epoch")

        def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
            noticed = group.gather(int(notice.is_set()))  # after the chief's backup of this epoch
            if any(noticed) and epoch + 1 < epochs:
                if not self.said:
                    on_notice()
                raise Preempted(f"saved a checkpoint at the end of epoch {epoch + 1} on notice to task(s) "
                                f"{[i for i, flag in enumerate(noticed) if flag]}")

    return [Backup(), Stopper()]
