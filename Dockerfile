# The rollout buffer service alone (the base install: no torch, no CUDA).
#   docker build -t rollout-buffer .
#   docker run -p 8889:8889 -v "$PWD/my_generators:/app/generator:ro" rollout-buffer
# The buffer is kept on disk in /data (a volume: mount one to keep it across containers,
# e.g. -v rollout-data:/data); docker stop sends SIGTERM, which flushes it and exits 0.
# Options are flags (docker run rollout-buffer python buffer.py --help) or
# ROLLOUT_BUFFER_* variables, e.g. -e ROLLOUT_BUFFER_GROUP_SIZE=8.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# pyproject.toml names README.md as the readme, so the build needs it; the build also
# needs every package and module it lists: buffer, generator and default_func.
COPY pyproject.toml README.md LICENSE ./
COPY buffer.py default_func.py ./
COPY buffer/ buffer/
COPY generator/ generator/
RUN pip install . \
    && rm -rf build ./*.egg-info

RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin rollout \
    && mkdir /data && chown rollout /data
USER rollout
ENV ROLLOUT_BUFFER_DATA_DIR=/data
VOLUME /data

EXPOSE 8889
HEALTHCHECK --interval=30s --timeout=5s --start-period=10s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('ROLLOUT_BUFFER_PORT', '8889'), timeout=4)"

# Listens on 0.0.0.0:8889 by default; generators are read from /app/generator.
CMD ["python", "buffer.py"]
