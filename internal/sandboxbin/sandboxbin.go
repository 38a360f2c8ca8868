// Package sandboxbin finds the lean in-sandbox stasis binary
// (cmd/stasis-sandbox) that the host places in sandboxes by default. The full
// stasis binary embeds the built-in tasks and the scripted model's reference
// solutions, so it is never the default: an agent could read the answers in
// it.
package sandboxbin

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
)

// Name is the lean binary's file name, looked for beside the running stasis.
const Name = "stasis-sandbox"

// Env names the lean binary explicitly.
const Env = "STASIS_SANDBOX_BINARY"

// Path is the lean binary to place in sandboxes: $STASIS_SANDBOX_BINARY, or
// stasis-sandbox in the running executable's directory.
func Path() (string, error) {
	if p := os.Getenv(Env); p != "" {
		return check(p, Env+" names "+p)
	}
	exe, err := os.Executable()
	if err != nil {
		return "", fmt.Errorf("the in-sandbox binary: %w", err)
	}
	if r, err := filepath.EvalSymlinks(exe); err == nil {
		exe = r
	}
	return check(filepath.Join(filepath.Dir(exe), Name), "looked beside "+exe)
}

func check(p, where string) (string, error) {
	fi, err := os.Stat(p)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return "", fmt.Errorf("the in-sandbox binary %s is missing (%s): build it with `make build`, or `CGO_ENABLED=0 go build -o %s ./cmd/stasis-sandbox`, or name it with %s", p, where, p, Env)
	case err != nil:
		return "", fmt.Errorf("the in-sandbox binary: %w", err)
	case fi.IsDir() || fi.Mode().Perm()&0o111 == 0:
		return "", fmt.Errorf("the in-sandbox binary %s (%s) is not an executable file", p, where)
	}
	return filepath.Abs(p)
}
