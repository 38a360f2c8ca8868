// Package atomicfile writes files so that a reader, or a crash, sees either
// the old content or the whole new content, never a part: the bytes go to a
// temporary file in the same directory, are fsync'd, renamed over the target,
// and the directory is fsync'd so the rename itself is durable. Replace
// skips both fsyncs, for files a memory snapshot keeps with the page cache.
package atomicfile

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// Write replaces path with data, atomically and durably, with permission perm.
func Write(path string, data []byte, perm os.FileMode) error {
	return write(path, data, perm, true)
}

// Replace replaces path with data atomically (a reader sees the old or the
// new content, never a part) but not durably: nothing is fsync'd, so a
// crash of the machine may lose it. It is for files whose only copy that
// matters is the one a memory snapshot takes with the page cache.
func Replace(path string, data []byte, perm os.FileMode) error {
	return write(path, data, perm, false)
}

// ReplaceJSON is WriteJSON through Replace.
func ReplaceJSON(path string, v any, perm os.FileMode) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return Replace(path, append(b, '\n'), perm)
}

func write(path string, data []byte, perm os.FileMode, durable bool) error {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp*")
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	tmp := f.Name()
	ok := false
	defer func() {
		if !ok {
			_ = f.Close()
			_ = os.Remove(tmp)
		}
	}()
	if err := f.Chmod(perm); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	if _, err := f.Write(data); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	if durable {
		if err := f.Sync(); err != nil {
			return fmt.Errorf("write %s: fsync: %w", path, err)
		}
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	ok = true
	if !durable {
		return nil
	}
	return SyncDir(dir)
}

// WriteJSON writes v as indented JSON followed by a newline, atomically.
func WriteJSON(path string, v any, perm os.FileMode) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return Write(path, append(b, '\n'), perm)
}

// SyncDir fsyncs a directory so that entries created or renamed in it are
// durable.
func SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("fsync %s: %w", dir, err)
	}
	return nil
}

// SyncFS flushes the whole file system that holds dir (syncfs(2)): one call
// makes durable everything written there, however many files.
func SyncFS(dir string) error {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return &os.PathError{Op: "open", Path: dir, Err: err}
	}
	defer unix.Close(fd)
	if err := unix.Syncfs(fd); err != nil {
		return &os.PathError{Op: "syncfs", Path: dir, Err: err}
	}
	return nil
}
