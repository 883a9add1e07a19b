# vLLM's OpenAI server image with the kvdepot client (the connector kvdepot.client.vllm).
# Build from the repository root:
#
#   podman build --format docker -f deploy/docker/vllm-kvdepot.Dockerfile -t localhost/vllm-kvdepot:0.33.0 .
#
# Only the client is installed (it needs grpcio and protobuf besides vLLM): the daemon runs
# in its own container (deploy/docker/kvdepot.Dockerfile). vLLM's image installs its Python
# packages with `uv pip install --system`, and so does this.
ARG VLLM_IMAGE=docker.io/vllm/vllm-openai:v0.33.0

FROM ${VLLM_IMAGE}
# The repository, less what .dockerignore keeps out (virtual environments, tests, .git).
COPY . /tmp/kvdepot-src
# No extras: vLLM's own pins stay as they are.
RUN uv pip install --system --no-cache /tmp/kvdepot-src \
    && rm -rf /tmp/kvdepot-src \
    && python3 -c "import kvdepot.client"
