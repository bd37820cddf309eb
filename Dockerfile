# Two stages: build the single static-ish binary, then ship it on a small Debian base.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock build.rs ./
# The build's settings (the bundled SQLite's compile options).
COPY .cargo ./.cargo
COPY src ./src
COPY benches ./benches
COPY migrations ./migrations
# The order LLD lays the release binary's functions out in (build.rs; ~8 MiB less mapped).
COPY deploy/symbol-order.txt ./deploy/
RUN cargo build --release --locked --bin stable-harness

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --create-home --home-dir /srv stable-harness
COPY --from=build /src/target/release/stable-harness /usr/local/bin/stable-harness
COPY workspace-example /srv/workspace
RUN chown -R stable-harness /srv/workspace
USER stable-harness
WORKDIR /srv/workspace
EXPOSE 8642
# Binding 0.0.0.0 requires admin keys (STABLE_HARNESS_ADMIN_KEY): an open admin surface is
# only allowed on loopback.
ENTRYPOINT ["stable-harness"]
CMD ["start", "-w", "/srv/workspace", "--host", "0.0.0.0", "--port", "8642"]
