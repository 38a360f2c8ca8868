package image

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"sort"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// IDRange is how many ids of an image keep their own number (shifted by
// the store's IDBase); a file owned by an id past it belongs to the
// overflow id, nobody (65534).
const (
	IDRange    = 65536
	overflowID = 65534
)

// unpackStats counts what an unpack wrote and left out.
type unpackStats struct {
	Files, Dirs, Links int
	Bytes              int64
	// Devices are device nodes left out: a sandbox has a /dev of its own,
	// and an image's nodes would be no use on its read-only, nodev root.
	Devices int
	// Hidden are lower layers' entries an upper layer's directory hides.
	Hidden int
}

// unpacker writes a flattened image file system (mutate.Extract's tar:
// whiteouts applied, each name once, upper layers first) into root.
//
// Every path is resolved inside root (os.Root), and no component of an
// entry's path may be a link: the stream never leads through one (a
// non-directory hides what a lower layer had under its name), so one
// there is a hostile stream, refused.
// Owners are the image's ids shifted by idBase, so a user namespace that
// maps 0 … IDRange-1 to idBase … sees the image's own owners; modes
// (setuid and setgid included), times, links and extended attributes are
// the image's. Directory metadata is applied last, deepest first, so
// later entries do not disturb it; hard links are made last, since their
// target may come later in the stream.
type unpacker struct {
	root     *os.Root
	idBase   int
	stats    unpackStats
	dirs     []*tar.Header
	links    []*tar.Header
	progress func(unpackStats)
	last     time.Time
}

func (u *unpacker) id(n int) int {
	if n < 0 || n >= IDRange {
		n = overflowID
	}
	return u.idBase + n
}

// clean turns a tar name into a relative path inside root, refusing one
// that would leave it.
func clean(name string) (string, error) {
	for _, c := range strings.Split(name, "/") {
		if c == ".." {
			return "", fmt.Errorf("tar entry %q leaves the image's root", name)
		}
	}
	p := path.Clean("/" + name)
	if p == "/" {
		return ".", nil
	}
	return strings.TrimPrefix(p, "/"), nil
}

func (u *unpacker) run(ctx context.Context, r io.Reader) error {
	tr := tar.NewReader(r)
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return fmt.Errorf("read the image's layers: %w", err)
		}
		if err := u.entry(h, tr); err != nil {
			return fmt.Errorf("unpack %s: %w", h.Name, err)
		}
		if u.progress != nil && time.Since(u.last) > 200*time.Millisecond {
			u.last = time.Now()
			u.progress(u.stats)
		}
	}
	for _, h := range u.links {
		if err := u.hardlink(h); err != nil {
			return fmt.Errorf("unpack %s: %w", h.Name, err)
		}
	}
	// Deepest first, so a parent's time is set after its children's.
	sort.SliceStable(u.dirs, func(i, j int) bool {
		return strings.Count(u.dirs[i].Name, "/") > strings.Count(u.dirs[j].Name, "/")
	})
	for _, h := range u.dirs {
		rel, _ := clean(h.Name)
		if err := u.meta(rel, h); err != nil {
			return fmt.Errorf("unpack %s: %w", h.Name, err)
		}
	}
	if u.progress != nil {
		u.progress(u.stats)
	}
	return nil
}

// parent opens the directory that will hold rel (made, 0755 and the
// shifted root's, when the stream has not yet named it) and returns it
// with rel's last component.
func (u *unpacker) parent(rel string) (*os.File, string, error) {
	dir, base := path.Split(rel)
	dir = strings.TrimSuffix(dir, "/")
	if dir == "" {
		dir = "."
	}
	if dir != "." {
		if err := u.mkdirAll(dir); err != nil {
			return nil, "", err
		}
	}
	f, err := u.root.OpenFile(dir, os.O_RDONLY|unix.O_DIRECTORY, 0)
	if err != nil {
		return nil, "", err
	}
	return f, base, nil
}

// mkdirAll makes dir and its missing parents one by one, refusing to go
// through anything that is not a directory (a symlink included).
func (u *unpacker) mkdirAll(dir string) error {
	cur := "."
	for _, c := range strings.Split(dir, "/") {
		next := path.Join(cur, c)
		fi, err := u.root.Lstat(next)
		switch {
		case err == nil && fi.IsDir():
		case err == nil:
			return fmt.Errorf("%s is not a directory in the image (a %s): no entry goes through it", next, kind(fi.Mode()))
		case errors.Is(err, os.ErrNotExist):
			if err := u.root.Mkdir(next, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
				return err
			}
			if err := u.root.Lchown(next, u.id(0), u.id(0)); err != nil {
				return err
			}
		default:
			return err
		}
		cur = next
	}
	return nil
}

func (u *unpacker) entry(h *tar.Header, r io.Reader) error {
	rel, err := clean(h.Name)
	if err != nil {
		return err
	}
	if rel == "." {
		if h.Typeflag == tar.TypeDir {
			u.dirs = append(u.dirs, h)
		}
		return nil
	}
	switch h.Typeflag {
	case tar.TypeDir:
		if err := u.mkdirAll(rel); err != nil {
			return err
		}
		u.stats.Dirs++
		u.dirs = append(u.dirs, h)
		return nil
	case tar.TypeLink:
		u.links = append(u.links, h)
		return nil
	case tar.TypeChar, tar.TypeBlock:
		u.stats.Devices++
		return nil
	}
	dir, base, err := u.parent(rel)
	if err != nil {
		return err
	}
	defer dir.Close()
	dfd := int(dir.Fd())
	// The stream names each path once, upper layers first, so what is
	// there already is a directory an upper layer made to hold its own
	// entries: it hides this lower entry, as an overlay's upper directory
	// hides a lower file.
	var st unix.Stat_t
	if err := unix.Fstatat(dfd, base, &st, unix.AT_SYMLINK_NOFOLLOW); err == nil {
		u.stats.Hidden++
		return nil
	}
	switch h.Typeflag {
	case tar.TypeReg: // the reader reports the old TypeRegA as TypeReg
		fd, err := unix.Openat(dfd, base, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
		if err != nil {
			return err
		}
		f := os.NewFile(uintptr(fd), rel)
		n, err := io.Copy(f, r)
		if err == nil && n != h.Size {
			err = fmt.Errorf("%d bytes of %d", n, h.Size)
		}
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return err
		}
		u.stats.Files++
		u.stats.Bytes += n
	case tar.TypeSymlink:
		if err := unix.Symlinkat(h.Linkname, dfd, base); err != nil {
			return err
		}
		u.stats.Links++
	case tar.TypeFifo:
		if err := unix.Mknodat(dfd, base, unix.S_IFIFO|0o600, 0); err != nil {
			return err
		}
		u.stats.Files++
	default:
		return fmt.Errorf("tar entry type %q is not a file system object", h.Typeflag)
	}
	return u.metaAt(dfd, base, h)
}

// hardlink makes h, a hard link to a path unpacked before it.
func (u *unpacker) hardlink(h *tar.Header) error {
	rel, err := clean(h.Name)
	if err != nil {
		return err
	}
	target, err := clean(h.Linkname)
	if err != nil || target == "." {
		return fmt.Errorf("hard link to %q: not a file in the image", h.Linkname)
	}
	tdir, tbase, err := u.parent(target)
	if err != nil {
		return fmt.Errorf("hard link to %s: %w", h.Linkname, err)
	}
	defer tdir.Close()
	var st unix.Stat_t
	if err := unix.Fstatat(int(tdir.Fd()), tbase, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("hard link to %s: %w", h.Linkname, err)
	}
	if st.Mode&unix.S_IFMT == unix.S_IFDIR {
		return fmt.Errorf("hard link to %s, a directory", h.Linkname)
	}
	dir, base, err := u.parent(rel)
	if err != nil {
		return err
	}
	defer dir.Close()
	if err := unix.Unlinkat(int(dir.Fd()), base, 0); err != nil && !errors.Is(err, unix.ENOENT) {
		return err
	}
	if err := unix.Linkat(int(tdir.Fd()), tbase, int(dir.Fd()), base, 0); err != nil {
		return err
	}
	u.stats.Links++
	return nil
}

// meta applies h's owner, mode, times and extended attributes to rel.
func (u *unpacker) meta(rel string, h *tar.Header) error {
	if rel == "." {
		f, err := u.root.OpenFile(".", os.O_RDONLY|unix.O_DIRECTORY, 0)
		if err != nil {
			return err
		}
		defer f.Close()
		return u.fdMeta(f, h)
	}
	dir, base, err := u.parent(rel)
	if err != nil {
		return err
	}
	defer dir.Close()
	return u.metaAt(int(dir.Fd()), base, h)
}

func (u *unpacker) metaAt(dfd int, base string, h *tar.Header) error {
	if h.Typeflag == tar.TypeSymlink {
		if err := unix.Fchownat(dfd, base, u.id(h.Uid), u.id(h.Gid), unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return err
		}
		return utimes(dfd, base, h)
	}
	fd, err := unix.Openat(dfd, base, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		return err
	}
	f := os.NewFile(uintptr(fd), base)
	defer f.Close()
	if err := u.fdMeta(f, h); err != nil {
		return err
	}
	return utimes(dfd, base, h)
}

// fdMeta sets owner, mode (after the owner: chown clears setuid) and
// extended attributes through an open descriptor.
func (u *unpacker) fdMeta(f *os.File, h *tar.Header) error {
	fd := int(f.Fd())
	if err := unix.Fchown(fd, u.id(h.Uid), u.id(h.Gid)); err != nil {
		return err
	}
	if err := unix.Fchmod(fd, tarMode(h)); err != nil {
		return err
	}
	for k, v := range h.PAXRecords {
		attr, ok := strings.CutPrefix(k, "SCHILY.xattr.")
		if !ok {
			continue
		}
		if err := unix.Fsetxattr(fd, attr, []byte(v), 0); err != nil && !errors.Is(err, unix.ENOTSUP) {
			return fmt.Errorf("extended attribute %s: %w", attr, err)
		}
	}
	return nil
}

// tarMode is h's permission bits with setuid, setgid and sticky.
func tarMode(h *tar.Header) uint32 {
	m := uint32(h.Mode) & 0o777
	if h.Mode&0o4000 != 0 {
		m |= unix.S_ISUID
	}
	if h.Mode&0o2000 != 0 {
		m |= unix.S_ISGID
	}
	if h.Mode&0o1000 != 0 {
		m |= unix.S_ISVTX
	}
	return m
}

func utimes(dfd int, base string, h *tar.Header) error {
	at := h.AccessTime
	if at.IsZero() {
		at = h.ModTime
	}
	ts := []unix.Timespec{unix.NsecToTimespec(at.UnixNano()), unix.NsecToTimespec(h.ModTime.UnixNano())}
	return unix.UtimesNanoAt(dfd, base, ts, unix.AT_SYMLINK_NOFOLLOW)
}

// kind names a file type for a message.
func kind(m os.FileMode) string {
	switch {
	case m&os.ModeSymlink != 0:
		return "symbolic link"
	case m.IsRegular():
		return "file"
	case m&os.ModeNamedPipe != 0:
		return "fifo"
	}
	return m.Type().String()
}
