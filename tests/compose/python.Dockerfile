# Stand-in for python:3.11-slim: Debian bookworm's own Python 3.11 instead of one compiled into /usr/local.
# The official image's contract kept: python, python3, pip on PATH in /usr/local/bin, packages installed into
# /usr/local/lib/python3.11/site-packages, root user, apt usable, CMD python3. A venv rooted at /usr/local gives
# exactly those paths over Debian's interpreter (and, being a venv, no PEP 668 "externally managed" refusal).
FROM wsgate-standin/bookworm-slim
ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8 \
    PYTHON_VERSION=3.11
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv netbase tzdata \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /usr/local \
 && rm -rf /root/.cache \
 && python --version && pip --version
CMD ["python3"]
