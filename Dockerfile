# syntax=docker/dockerfile:1
# One image for the three services of the stack; the command picks one:
#   python -m tokenizer_service | python -m model_service | python -m gateway
# Build for CPU (default) or for NVIDIA GPUs with `--build-arg JAX_CUDA=cuda12`. x86-64 Linux only: the build
# fails unless the native CPU kernels (model_service/kernels/native) compile and load.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# Stage 1: a virtualenv holding exactly the dependencies pinned in pyproject.toml.
FROM ${PYTHON_IMAGE} AS deps
# "" keeps the CPU jaxlib; "cuda12" (or "cuda13") adds JAX's CUDA plugin at the same jax version.
ARG JAX_CUDA=""
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
WORKDIR /build
COPY pyproject.toml ./
# The pins come from [project.dependencies]; with JAX_CUDA set, `jax==X` becomes `jax[cuda12]==X`.
RUN python -m venv /opt/venv \
 && python -c "import os, tomllib; \
extra = os.environ.get('JAX_CUDA', ''); \
deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; \
deps = [d.replace('jax==', f'jax[{extra}]==', 1) if extra and d.startswith('jax==') else d for d in deps]; \
open('requirements.txt', 'w').write('\n'.join(deps) + '\n')" \
 && pip install --no-cache-dir -r requirements.txt

# Stage 2: the native CPU kernels, compiled by pip through setup.py; the C++ compiler lives in this stage only.
# setup.py compiles for baseline x86-64 and each instruction-set path (scalar, AVX2, AVX-512) is chosen at run
# time, so the image runs on any x86-64 host, whichever CPU built it.
FROM deps AS kernels
# The compiler never reaches the runtime stage; the base image's Debian release picks its version.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
# Only what the extension needs, so editing other source does not recompile it.
COPY setup.py ./
COPY model_service/__init__.py model_service/
COPY model_service/kernels/ model_service/kernels/
# --no-build-isolation: the FFI headers come from the very jaxlib the runtime imports (no second download);
# --target: the built package lands in /native, apart from the venv the runtime copies.
RUN pip install --no-cache-dir setuptools==84.2.1 \
 && pip install --no-cache-dir --no-deps --no-build-isolation --no-compile --target /native .

# Stage 3: the runtime: the venv, the source with the compiled kernels beside it (as an in-place build leaves
# them), and the embedded default (demo/: the trained demo model and its tokenizer, committed to the repository,
# so nothing is trained or generated here); no compilers, no pip cache.
FROM ${PYTHON_IMAGE} AS runtime
RUN groupadd --system --gid 10001 grok \
 && useradd --system --uid 10001 --gid grok --create-home --home-dir /home/grok --shell /usr/sbin/nologin grok \
 && install -d -o grok -g grok /var/cache/grok
COPY --from=deps /opt/venv /opt/venv
WORKDIR /app
COPY . .
COPY --from=kernels /native/model_service/kernels/_native*.so model_service/kernels/
# PORT only feeds the image's HEALTHCHECK (docker run); the compose file has its own per service.
# The services listen on 127.0.0.1 by default; in a container only the container's own network
# namespace is reachable, so they listen on every interface of it (publishing stays a `-p` choice).
# GROK_TOKENIZER_HOST is an address, not a secret (DL3064 matches the "TOKEN" in its name).
# hadolint ignore=DL3064
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/app \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PORT=50051 \
    GROK_GATEWAY_HOST=0.0.0.0 \
    GROK_TOKENIZER_HOST=0.0.0.0 \
    GROK_MODEL_HOST=0.0.0.0
USER 10001:10001
# A deployment image without the kernels would silently serve on XLA's slower products: refuse to build it.
RUN python -c "from model_service import kernels; \
assert kernels.available(), 'the native kernels did not build or load: see the kernels stage log'; \
print('native kernels:', kernels.supported_isas())"
EXPOSE 50051 50052 50053 8000 9090
# The servers install their own SIGTERM handler (drain, then exit 0), so exec form keeps
# python as the process that receives the signal; compose adds `init: true` as well.
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
  CMD ["/bin/sh", "-c", "exec python -m serving_common.healthcheck 127.0.0.1:${PORT}"]
CMD ["python", "-m", "gateway"]
