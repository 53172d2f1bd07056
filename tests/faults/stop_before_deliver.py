"""`python -m jaxrl.distributed.sampler_main` (jaxrl-sampler) that stops itself (SIGSTOP) right before its
$JAXRL_FAULTS_STOP_BEFORE_DELIVER-th delivery of finished groups to the learner, with those groups in hand, and
from then on appends every delivery it makes to $JAXRL_FAULTS_DELIVER_LOG (one JSON line each: the registration,
the groups, their samples, the learner's reply). A test lets its lease expire, wakes it (SIGCONT) and checks that
what it delivered for groups the learner had since handed to another sampler was refused as fenced."""

import json
import os
import signal

import numpy as np

from jaxrl.distributed import packets, remote, rpc, sampler_main

_put_all, _call = remote.RemoteRollouts.put_all, rpc.call
_deliveries = 0
_stopped = False


def _log(entry: dict) -> None:
  with open(os.environ["JAXRL_FAULTS_DELIVER_LOG"], "a") as f:
    f.write(json.dumps(entry) + "\n")


def _stopping_put_all(self, groups):
  global _deliveries, _stopped
  _deliveries += 1
  if _deliveries == int(os.environ["JAXRL_FAULTS_STOP_BEFORE_DELIVER"]):
    _stopped = True
    _log({"event": "stop", "sampler": self.coord.sampler, "groups": [g[0].group_id for g in groups]})
    os.kill(os.getpid(), signal.SIGSTOP)
  _put_all(self, groups)


def _logged_call(address, method, request, **kw):
  """rpc.call, which RemoteRollouts.put_all and a new registration's report of the last one's groups both use."""
  reply = _call(address, method, request, **kw)
  if _stopped and method == "deliver":
    packet = np.asarray(request["packet"])
    max_len = (packet.shape[1] - packets.packet_width(0)) // 3  # a policy without routing (configs/tiny.py)
    groups = packets.decode(packet, max_len)
    _log({"event": "deliver", "sampler": request["sampler"], "groups": [g[0].group_id for g in groups],
          "samples": sum(map(len, groups)), "reply": reply})
  return reply


remote.RemoteRollouts.put_all = _stopping_put_all
rpc.call = _logged_call

if __name__ == "__main__":
  sampler_main.main()
