"""`python -m jaxrl.train` with orbax's checkpoint commit (the rename of a finished temporary folder into its
step folder) held for ten minutes from step $JAXRL_FAULTS_HOLD_STEP on, after touching workdir/saving-<step>: a
test SIGKILLs the process while that save is under way."""

import asyncio
import os

from orbax.checkpoint._src.path import atomicity

from jaxrl import train

_commit = atomicity.AtomicRenameTemporaryPath.finalize


async def _held_commit(self):
  final = self.get_final()
  if final.name.isdigit() and int(final.name) >= int(os.environ["JAXRL_FAULTS_HOLD_STEP"]):
    (final.parent.parent / f"saving-{final.name}").touch()
    await asyncio.sleep(600)
  await _commit(self)


atomicity.AtomicRenameTemporaryPath.finalize = _held_commit

if __name__ == "__main__":
  train.main()
