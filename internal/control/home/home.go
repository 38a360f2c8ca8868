// Package home locates stasis's state directory: $STASIS_HOME, or
// ~/.local/share/stasis when it is unset. The record store, the blob store
// and the local sandboxes all live below it.
package home

import (
	"fmt"
	"os"
	"path/filepath"
)

// Env is the environment variable that overrides the state directory.
const Env = "STASIS_HOME"

// Dir returns the state directory, creating it (mode 0700) if missing.
func Dir() (string, error) {
	d := os.Getenv(Env)
	if d == "" {
		h, err := os.UserHomeDir()
		if err != nil {
			return "", fmt.Errorf("state directory: set %s or HOME: %w", Env, err)
		}
		d = filepath.Join(h, ".local", "share", "stasis")
	}
	d, err := filepath.Abs(d)
	if err != nil {
		return "", err
	}
	if err := os.MkdirAll(d, 0o700); err != nil {
		return "", fmt.Errorf("state directory %s: %w", d, err)
	}
	return d, nil
}

// Sub returns a subdirectory of the state directory, creating it.
func Sub(name string) (string, error) {
	d, err := Dir()
	if err != nil {
		return "", err
	}
	p := filepath.Join(d, name)
	if err := os.MkdirAll(p, 0o700); err != nil {
		return "", fmt.Errorf("state directory %s: %w", p, err)
	}
	return p, nil
}
