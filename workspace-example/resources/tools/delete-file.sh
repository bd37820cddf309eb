#!/bin/sh
# files.delete: governance denies every call (rule `no-deletes`), so this never runs.
# It exists so the tool has a real implementation; it refuses to do anything anyway.
cat >/dev/null
printf '{"error":"deleting files is disabled in the example workspace"}\n'
exit 1
