# Stand-in for rust:1.95-slim, as its official Dockerfile makes it: rustup-init (version and checksum pinned)
# from static.rust-lang.org installs the minimal profile of the toolchain into /usr/local/rustup and
# /usr/local/cargo. Only the base differs: Debian bookworm-slim made here, not the registry's debian image.
FROM wsgate-standin/bookworm-slim
ARG RUST_VERSION
ENV RUSTUP_HOME=/usr/local/rustup \
    CARGO_HOME=/usr/local/cargo \
    PATH=/usr/local/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    RUST_VERSION=${RUST_VERSION}
RUN set -eux; \
    apt-get update; \
    apt-get install -y --no-install-recommends gcc libc6-dev wget; \
    url=https://static.rust-lang.org/rustup/archive/1.29.0/x86_64-unknown-linux-gnu/rustup-init; \
    wget -q "$url"; \
    echo "4acc9acc76d5079515b46346a485974457b5a79893cfb01112423c89aeb5aa10 *rustup-init" | sha256sum -c -; \
    chmod +x rustup-init; \
    ./rustup-init -y --no-modify-path --profile minimal --default-toolchain "$RUST_VERSION" \
        --default-host x86_64-unknown-linux-gnu; \
    rm rustup-init; \
    chmod -R a+w "$RUSTUP_HOME" "$CARGO_HOME"; \
    rustup --version; cargo --version; rustc --version; \
    apt-get remove -y --auto-remove wget; \
    rm -rf /var/lib/apt/lists/*
