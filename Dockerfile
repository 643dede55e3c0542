# Weir: one image for every component. CPU torch by default; --build-arg TORCH_INDEX=cu124
# (or another PyTorch wheel index suffix) builds a CUDA image.
FROM python:3.11-slim
ARG TORCH_INDEX=cpu
ARG TORCH_VERSION=2.13.0
WORKDIR /opt/weir
# g++ builds the native CPU decode-attention kernel at first use (kernels/cpu_native.py)
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" \
        --index-url "https://download.pytorch.org/whl/${TORCH_INDEX}"
COPY pyproject.toml README.md ./
COPY weir weir
COPY bus bus
COPY schemas schemas
COPY components components
COPY kernels kernels
RUN pip install --no-cache-dir -e .
COPY deploy/compose.toml /etc/weir/weir.toml
ENV WEIR_CACHE_DIR=/var/cache/weir
# Fetch the default model at build time so containers start without network access.
RUN python -m components.model.fetch
STOPSIGNAL SIGTERM
