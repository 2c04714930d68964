"""Reading and setting a Deployment's replica count through the scale subresource.

Only GET and PATCH on `deployments/{name}/scale` are used: that is all the chart's Role
grants the planner. Every failure (API down, 403, 404, timeout) becomes one `ScaleAPIError`
whose message says which call failed and why, so the loop can log it and hold.
"""

from __future__ import annotations

from typing import Any

MERGE_PATCH = "application/merge-patch+json"


class ScaleAPIError(RuntimeError):
    pass


class KubeScaler:
    def __init__(self, namespace: str, api_url: str | None = None, timeout_s: float = 5.0):
        """`api_url` None: the in-cluster service account (or, outside a cluster, the local
        kubeconfig). A URL is used as is, without credentials (e.g. `kubectl proxy`)."""
        # Imported here: the client takes a second to import and only this command needs it.
        from kubernetes import client, config

        self.namespace = namespace
        self.timeout_s = timeout_s
        if api_url is not None:
            configuration = client.Configuration()
            configuration.host = api_url.rstrip("/")
        else:
            configuration = _cluster_configuration(config, client)
        # One retry on a dropped connection; a longer outage is the loop's to ride out.
        configuration.retries = 1
        self._api = client.AppsV1Api(client.ApiClient(configuration))

    def get_replicas(self, deployment: str) -> int:
        scale = self._call(
            f"GET scale of deployment {self.namespace}/{deployment}",
            self._api.read_namespaced_deployment_scale,
            deployment,
            self.namespace,
        )
        return int(scale.spec.replicas or 0) if scale.spec is not None else 0

    def set_replicas(self, deployment: str, replicas: int) -> None:
        self._call(
            f"PATCH scale of deployment {self.namespace}/{deployment} to {replicas}",
            self._api.patch_namespaced_deployment_scale,
            deployment,
            self.namespace,
            {"spec": {"replicas": replicas}},
            _content_type=MERGE_PATCH,
        )

    def _call(self, what: str, method, *args: Any, **kwargs: Any) -> Any:
        from kubernetes.client.exceptions import ApiException

        try:
            return method(*args, _request_timeout=self.timeout_s, **kwargs)
        except ApiException as exc:
            raise ScaleAPIError(f"{what}: HTTP {exc.status} {exc.reason}") from exc
        except Exception as exc:  # urllib3 and socket errors: unreachable, timed out, reset
            raise ScaleAPIError(f"{what}: {type(exc).__name__}: {exc}") from exc


def _cluster_configuration(config, client):
    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            config.load_kube_config()
        except (config.ConfigException, OSError) as exc:
            raise ScaleAPIError(
                f"no Kubernetes API configured: not in a cluster and no kubeconfig ({exc}); "
                "pass --kube-api URL"
            ) from exc
    return client.Configuration.get_default_copy()
