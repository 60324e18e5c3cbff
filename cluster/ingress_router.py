"""The ingress deployment's request router: Serve's default (power of two choices), except that a
`drain` (or `cut`) call names the ingress replicas it has asked already and goes to another one.

`kvserve serve` drains every ingress replica before it stops Serve (router.ingress.OpenAIIngress.drain).
A handle reaches a deployment, not a replica, and power of two choices sends each call to the
shorter of two queues, so a replica busy with streams would never be asked while an idle one
was: it would go on taking requests, and the drain would wait out its whole timeout. Used where
there is more than one fixed ingress replica (cluster.app.ingress_deployment_options).
"""
from __future__ import annotations

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RunningReplica

# router.ingress.OpenAIIngress.drain(exclude=[replica key, ...]), and .cut, which a drain out of
# time calls the same way
EACH_REPLICA_METHODS = frozenset({"drain", "cut"})


class IngressRequestRouter(PowerOfTwoChoicesRequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is not None and pending_request.metadata.call_method in EACH_REPLICA_METHODS:
            done = set(pending_request.kwargs.get("exclude", ()))
            rest = [r for r in candidate_replicas if r.replica_id.to_full_id_str() not in done]
            return [rest or candidate_replicas]  # every one drained: any (the caller sees it again)
        return await super().choose_replicas(candidate_replicas, pending_request)


def ingress_router_config():
    from ray.serve.config import RequestRouterConfig

    return RequestRouterConfig(request_router_class=f"{__name__}:{IngressRequestRouter.__name__}")
