package cas

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"
)

// RestoreIndexed is Restore followed by Index: it returns, besides the
// restore's figures, the id of a manifest that describes dst as restored,
// for use as prev by the next Snapshot of dst. Without it, the first
// snapshot of a restored tree would read every file again (its inodes and
// ctimes are new); with it, that snapshot reads only what changed since the
// restore.
func (s *Store) RestoreIndexed(ctx context.Context, id, dst string) (index string, st Stats, err error) {
	st, err = s.Restore(ctx, id, dst)
	if err != nil {
		return "", st, err
	}
	index, err = s.Index(ctx, id, dst)
	return index, st, err
}

// Index returns the id of a manifest with the same content as manifest id
// whose change-detection fields (inode, device, ctime) are those of the
// files now at dir, which must hold exactly what id describes (it was just
// restored there and nothing has written to it since). Files whose ctime is
// too recent to prove a later change are marked to be read again. The new
// manifest names the same chunks, so it costs one small blob.
func (s *Store) Index(ctx context.Context, id, dir string) (string, error) {
	m, err := s.loadManifest(ctx, id)
	if err != nil {
		return "", fmt.Errorf("index %s: %w", dir, err)
	}
	now := time.Now()
	out := &manifest{Root: m.Root, Entries: make([]entry, len(m.Entries))}
	copy(out.Entries, m.Entries)
	for i := range out.Entries {
		e := &out.Entries[i]
		if e.Type != typeFile {
			continue
		}
		if err := ctx.Err(); err != nil {
			return "", err
		}
		var st unix.Stat_t
		p := filepath.Join(dir, string(e.Path))
		if err := unix.Lstat(p, &st); err != nil {
			return "", fmt.Errorf("index %s: %w", dir, &os.PathError{Op: "lstat", Path: p, Err: err})
		}
		if st.Mode&unix.S_IFMT != unix.S_IFREG || st.Size != e.Size || st.Mtim.Nano() != e.Mtime {
			return "", fmt.Errorf("index %s: %s does not match snapshot %s (changed since the restore?)", dir, p, id)
		}
		e.Ino, e.Dev, e.Ctime = st.Ino, st.Dev, st.Ctim.Nano()
		e.Racy = st.Ctim.Nano() >= now.Add(-s.racy).UnixNano()
	}
	b := out.encode()
	key := hashKey(b)
	if err := s.blobs.Put(ctx, key, b); err != nil {
		return "", fmt.Errorf("index %s: store manifest: %w", dir, err)
	}
	s.setComplete(key)
	return key, nil
}
