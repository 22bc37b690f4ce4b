# MedVQA web app. CPU by default, starting on the `offline` profile:
#
#   docker build -t medvqa .
#   docker run -p 127.0.0.1:7860:7860 -v medvqa-data:/data \
#       -v /path/to/shared/data/corpus:/data/corpus:ro medvqa
#
# CUDA: build on a CUDA runtime image and take torch from the matching PyTorch wheel index
# (BASE_IMAGE must provide glibc; Python is installed into it when it has none):
#
#   docker build -t medvqa:cuda \
#       --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#   docker run --gpus all -p 127.0.0.1:7860:7860 -v medvqa-data:/data medvqa:cuda
#
# /data holds what the first start builds (the converted decoder, the retrieval index, built while the
# app already serves) so later starts take seconds; /data/corpus is where the index is built from when
# /data/index has none.
# The app binds 0.0.0.0 inside the container (Docker publishes the port), which app.py refuses without
# a login unless told otherwise: the CMD passes --insecure-no-login because the commands above publish
# the port on 127.0.0.1 only. Set MEDVQA_USERNAME and MEDVQA_PASSWORD (docker run -e ...) to require a
# login whenever the port is published for others to reach.

# Build argument: the base image. python:3.11-slim (CPU) by default; a CUDA runtime image for GPUs.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

# Build argument: where torch comes from. The CPU wheels by default (the PyPI torch is a CUDA build
# of several GB); https://download.pytorch.org/whl/cu128 or similar with a CUDA base image.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DEBIAN_FRONTEND=noninteractive \
    GRADIO_ANALYTICS_ENABLED=False \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    MEDVQA_PROFILE=offline \
    MEDVQA_CACHE=/data/cache \
    MEDVQA_RETRIEVAL__INDEX_DIR=/data/index \
    MEDVQA_RETRIEVAL__CORPUS=/data/corpus/pubmed_abstracts.jsonl:/data/corpus/roco_captions.jsonl

# CUDA images come without Python; the python:* images have it already.
RUN if ! command -v python3 >/dev/null 2>&1; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-pip \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /app
COPY requirements.txt requirements-nodeps.txt ./
RUN pip install --index-url "${TORCH_INDEX_URL}" "$(grep -E '^torch==' requirements.txt)" \
    && pip install -r requirements.txt \
    && pip install --no-deps -r requirements-nodeps.txt

COPY . .
RUN pip install --no-deps -e . \
    && useradd --create-home --uid 1000 medvqa && mkdir -p /data && chown -R medvqa /data
USER medvqa
VOLUME ["/data"]
EXPOSE 7860
CMD ["python", "app.py", "--profile", "offline", "--host", "0.0.0.0", "--port", "7860", "--insecure-no-login"]
