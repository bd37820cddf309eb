#!/bin/sh
# files.list: JSON arguments arrive on stdin (unused here); prints {"files": [...]} on stdout.
# The folder to list is the first argument, relative to the workspace (the working directory).
set -eu
cat >/dev/null
dir="${1:-resources}"
printf '{"files":['
first=1
find "$dir" -type f | sort | while IFS= read -r file; do
  escaped=$(printf '%s' "$file" | sed 's/\\/\\\\/g; s/"/\\"/g')
  if [ "$first" -eq 1 ]; then first=0; else printf ','; fi
  printf '"%s"' "$escaped"
done
printf ']}\n'
