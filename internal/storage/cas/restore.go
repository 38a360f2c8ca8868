package cas

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"stasis/internal/storage/atomicfile"
)

// Restore materialises snapshot id at dst, which must not exist (its parent
// must). The tree is built in a temporary sibling of dst, made durable
// (syncfs) and renamed to dst at the end: on any error, dst does not exist
// afterwards. Every chunk is checked against its key and length as it is
// read; a damaged one fails the restore with an error wrapping ErrCorrupt
// that names the file and the chunk. Ownership is restored too, which
// needs root (CAP_CHOWN) unless every entry belongs to the caller. A crash
// during a restore can leave the temporary sibling (.NAME.restoring-*)
// behind; it is safe to delete.
func (s *Store) Restore(ctx context.Context, id, dst string) (st Stats, err error) {
	start := time.Now()
	defer func() { st.Duration = time.Since(start) }()
	dst, err = filepath.Abs(dst)
	if err != nil {
		return st, fmt.Errorf("restore %s: %w", id, err)
	}
	if _, err := os.Lstat(dst); err == nil {
		return st, fmt.Errorf("restore %s into %s: %w; restore into a path that does not exist yet", id, dst, fs.ErrExist)
	} else if !errors.Is(err, fs.ErrNotExist) {
		return st, fmt.Errorf("restore %s into %s: %w", id, dst, err)
	}
	m, err := s.loadManifest(ctx, id)
	if err != nil {
		return st, fmt.Errorf("restore: %w", err)
	}
	parent := filepath.Dir(dst)
	tmp, err := os.MkdirTemp(parent, "."+filepath.Base(dst)+".restoring-")
	if err != nil {
		return st, fmt.Errorf("restore %s into %s: %w (the parent directory must exist and be writable)", id, dst, err)
	}
	defer func() {
		if err != nil {
			removeTree(tmp)
		}
	}()
	r := &restorer{s: s, root: tmp}
	if err := r.build(ctx, m); err != nil {
		return st, fmt.Errorf("restore %s into %s: %w", id, dst, err)
	}
	if err := atomicfile.SyncFS(tmp); err != nil {
		return st, fmt.Errorf("restore %s into %s: %w", id, dst, err)
	}
	if err := renameNoReplace(tmp, dst); err != nil {
		return st, fmt.Errorf("restore %s into %s: %w", id, dst, err)
	}
	if err := atomicfile.SyncDir(parent); err != nil {
		return r.st, fmt.Errorf("restore %s into %s: %w", id, dst, err)
	}
	return r.st, nil
}

// restorer is the state of one Restore. build's goroutine owns st's
// counts but ReadBytes, which the workers add to under mu.
type restorer struct {
	s    *Store
	root string
	mu   sync.Mutex
	st   Stats
}

func (r *restorer) at(p name) string { return filepath.Join(r.root, string(p)) }

// build makes the tree under r.root: directories and symlinks in manifest
// order (parents first) while workers fill the files, then hard links, then
// directory metadata, children before parents, so that filling a
// directory does not change its mtime and a read-only directory is
// finished last.
func (r *restorer) build(ctx context.Context, m *manifest) error {
	err := fanOut(ctx, r.s.workers,
		func(ctx context.Context, jobs chan *entry) error { return r.tops(ctx, m, jobs) },
		func() func(context.Context, *entry) error { return r.file })
	if err != nil {
		return err
	}
	for i := range m.Entries {
		if e := &m.Entries[i]; e.Type == typeHardlink {
			if err := unix.Link(r.at(e.Target), r.at(e.Path)); err != nil {
				return &os.LinkError{Op: "link", Old: string(e.Target), New: string(e.Path), Err: err}
			}
			r.st.Hardlinks++
		}
	}
	for i := len(m.Entries) - 1; i >= 0; i-- {
		if e := &m.Entries[i]; e.Type == typeDir {
			if err := setMeta(r.at(e.Path), e.meta, false); err != nil {
				return err
			}
		}
	}
	return setMeta(r.root, m.Root, false)
}

// tops creates directories and symlinks and hands files to the workers.
func (r *restorer) tops(ctx context.Context, m *manifest, jobs chan<- *entry) error {
	for i := range m.Entries {
		if err := ctx.Err(); err != nil {
			return err
		}
		e := &m.Entries[i]
		p := r.at(e.Path)
		switch e.Type {
		case typeDir:
			if err := unix.Mkdir(p, 0o700); err != nil {
				return &os.PathError{Op: "mkdir", Path: string(e.Path), Err: err}
			}
			r.st.Dirs++
		case typeSymlink:
			if err := unix.Symlink(string(e.Target), p); err != nil {
				return &os.PathError{Op: "symlink", Path: string(e.Path), Err: err}
			}
			if err := setMeta(p, e.meta, true); err != nil {
				return err
			}
			r.st.Symlinks++
		case typeFile:
			r.st.Files++
			r.st.Bytes += e.Size
			select {
			case jobs <- e:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
	}
	return nil
}

// file writes one file from its chunks, checking each, then sets its
// metadata.
func (r *restorer) file(ctx context.Context, e *entry) error {
	p := r.at(e.Path)
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_EXCL|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return err
	}
	defer f.Close()
	for j, c := range e.Chunks {
		data, err := readChunk(ctx, r.s.blobs, c)
		if err != nil {
			return fmt.Errorf("file %q: chunk %d of %d: %w", e.Path, j+1, len(e.Chunks), err)
		}
		if _, err := f.Write(data); err != nil {
			return err
		}
		r.mu.Lock()
		r.st.ReadBytes += c.Size
		r.mu.Unlock()
	}
	if err := f.Close(); err != nil {
		return err
	}
	return setMeta(p, e.meta, false)
}

// setMeta gives p its owner, mode (not for symlinks, whose mode Linux
// fixes at 0777) and mtime, in that order: chown clears setuid and setgid.
func setMeta(p string, m meta, symlink bool) error {
	if err := unix.Lchown(p, int(m.UID), int(m.GID)); err != nil {
		var cur unix.Stat_t
		if !errors.Is(err, unix.EPERM) || unix.Lstat(p, &cur) != nil || cur.Uid != m.UID || cur.Gid != m.GID {
			return fmt.Errorf("%s: %w (restoring owner %d:%d needs root or CAP_CHOWN)", p, &os.PathError{Op: "lchown", Path: p, Err: err}, m.UID, m.GID)
		}
	}
	if !symlink {
		if err := unix.Fchmodat(unix.AT_FDCWD, p, m.Mode, 0); err != nil {
			return &os.PathError{Op: "chmod", Path: p, Err: err}
		}
	}
	ts := []unix.Timespec{{Nsec: unix.UTIME_OMIT}, unix.NsecToTimespec(m.Mtime)}
	if err := unix.UtimesNanoAt(unix.AT_FDCWD, p, ts, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return &os.PathError{Op: "utimensat", Path: p, Err: err}
	}
	return nil
}

// renameNoReplace renames a directory to dst, refusing to replace anything
// there (rename(2) alone would replace an empty directory).
func renameNoReplace(tmp, dst string) error {
	err := unix.Renameat2(unix.AT_FDCWD, tmp, unix.AT_FDCWD, dst, unix.RENAME_NOREPLACE)
	switch {
	case err == nil:
		return nil
	case errors.Is(err, unix.EEXIST):
		return fmt.Errorf("%s appeared while restoring: %w; restore into a path that does not exist yet", dst, fs.ErrExist)
	case errors.Is(err, unix.EINVAL), errors.Is(err, unix.ENOSYS):
		// The file system lacks RENAME_NOREPLACE: check, then rename.
		if _, err := os.Lstat(dst); err == nil {
			return fmt.Errorf("%s appeared while restoring: %w; restore into a path that does not exist yet", dst, fs.ErrExist)
		}
		return os.Rename(tmp, dst)
	}
	return &os.LinkError{Op: "rename", Old: tmp, New: dst, Err: err}
}

// removeTree removes a partly restored tree, making its directories
// writable first if a plain removal fails (a restored read-only directory
// stops a caller without CAP_DAC_OVERRIDE).
func removeTree(p string) {
	if os.RemoveAll(p) == nil {
		return
	}
	_ = filepath.WalkDir(p, func(q string, d fs.DirEntry, err error) error {
		if err == nil && d.IsDir() {
			_ = os.Chmod(q, 0o700)
		}
		return nil
	})
	_ = os.RemoveAll(p)
}
