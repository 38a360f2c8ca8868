// Package copyout brings files out of a sandbox onto the host, for every
// provider: the one place where what a sandbox made becomes a host file.
//
// Whatever is in a sandbox was made by its agent, which is not trusted, and
// a provider's Download is a tar stream the agent can shape at will (on a
// hosted provider it is root and can replace tar itself). Extraction
// therefore trusts nothing in the stream:
//
//   - Modes keep their permission bits only (less the host's umask):
//     setuid and setgid are dropped everywhere and sticky on files, so no
//     file made in a sandbox can raise anyone's privileges on the host.
//     Extended attributes (file capabilities among them) and ACLs are never
//     restored.
//   - Nothing is chowned: everything written belongs to the user running
//     stasis, never to a uid the sandbox named.
//   - Device nodes and fifos are not made (a tar stream cannot hold a
//     socket); nor are sparse files (whose holes a tiny stream can make
//     any size), nor entries of types it does not know. Each such entry is
//     skipped with a warning naming it.
//   - Nothing is written outside the destination. Names are resolved from
//     it with os.Root (openat-style, symlinks confined); an entry that is
//     absolute, has a ".." leading out, or goes through a symlink is
//     skipped with a warning; a symlink that leads outside the destination
//     (absolute, or out through "..", alone or by way of other links) is
//     not kept; a hard link must name a regular file of the same stream.
//     An existing file is removed before its replacement is made, so no
//     write goes through a link that was there.
//   - A stream that is truncated or malformed is an error saying so.
package copyout

import (
	"archive/tar"
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"stasis/errdefs"
	"stasis/sandbox"
)

// Skipped is an entry of a stream that was not written to the host, and
// why.
type Skipped struct {
	Name   string `json:"name"`
	Reason string `json:"reason"`
}

func (s Skipped) String() string { return fmt.Sprintf("%q: %s", s.Name, s.Reason) }

// Options configure a copy.
type Options struct {
	// Warn is told of every entry not copied, as it is skipped (nil: only
	// Result.Skipped lists them).
	Warn func(Skipped)
}

// Result says what a copy wrote.
type Result struct {
	Files    int   `json:"files"`
	Dirs     int   `json:"dirs"`
	Symlinks int   `json:"symlinks"`
	Links    int   `json:"links"` // hard links
	Bytes    int64 `json:"bytes"` // of regular files
	// Skipped are the entries not written, in stream order.
	Skipped []Skipped `json:"skipped,omitempty"`
}

// MalformedError is a tar stream that cannot be read to its end.
type MalformedError struct {
	Dst     string
	Entries int    // entries read before the fault
	Entry   string // the entry being read, if the fault was in its data
	Err     error
}

func (e *MalformedError) Error() string {
	what := "malformed"
	if errors.Is(e.Err, io.ErrUnexpectedEOF) {
		what = "truncated"
	}
	at := fmt.Sprintf("after %d entries", e.Entries)
	if e.Entry != "" {
		at = fmt.Sprintf("in the data of entry %q", e.Entry)
	}
	return fmt.Sprintf("copy out into %s: the tar stream from the sandbox is %s (%s): %v; what was read before it is in place, but the copy is incomplete", e.Dst, what, at, e.Err)
}

func (e *MalformedError) Unwrap() error { return e.Err }

// Copy copies src inside sandbox id to dst on the host, as `stasis sandbox
// cp` does: a file to the file dst (mode 0644 less the umask: the host's
// copy of a file is never setuid, setgid or executable by surprise), a
// directory's contents into the directory dst (made if missing), by
// Download and Extract.
//
// A src that is neither (a fifo, say) is an error, as is one missing; dst
// is not left behind as an empty directory then.
func Copy(ctx context.Context, p sandbox.Files, id, src, dst string, o Options) (Result, error) {
	b, rerr := p.ReadFile(ctx, id, src)
	if rerr == nil {
		if err := writeFile(dst, b); err != nil {
			return Result{}, err
		}
		return Result{Files: 1, Bytes: int64(len(b))}, nil
	}
	_, serr := os.Lstat(dst)
	res, err := Download(ctx, p, id, src, dst, o)
	if err != nil && errors.Is(serr, fs.ErrNotExist) {
		_ = os.Remove(dst) // only if still empty
	}
	if err != nil && errors.Is(rerr, errdefs.ErrInvalid) {
		return res, rerr // the provider's word on what src is says more than tar's
	}
	return res, err
}

// writeFile writes data to the host file dst, replacing what is there.
// An existing dst is the host user's own choice of place (a symlink there
// is followed, as cp would); its mode is reset to 0644 less the umask.
func writeFile(dst string, data []byte) error {
	perm := 0o644 &^ umask()
	f, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, perm)
	if err != nil {
		return fmt.Errorf("copy out: %w", err)
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return fmt.Errorf("copy out: %w", err)
	}
	if err := f.Chmod(perm); err != nil { // an existing file keeps its mode through O_TRUNC
		f.Close()
		return fmt.Errorf("copy out: %w", err)
	}
	return f.Close()
}

// Download extracts the directory dir inside sandbox id into dst on the
// host (made if missing) with Extract. An error of the provider's (dir is
// missing, the sandbox is gone) comes before one of the stream's.
func Download(ctx context.Context, p sandbox.Files, id, dir, dst string, o Options) (Result, error) {
	pr, pw := io.Pipe()
	derr := make(chan error, 1)
	go func() {
		err := p.Download(ctx, id, dir, pw)
		pw.CloseWithError(err) // nil: EOF
		derr <- err
	}()
	res, xerr := Extract(pr, dst, o)
	if xerr == nil {
		// Whatever follows the end-of-archive marker is ignored, but the
		// provider must be let finish.
		_, xerr = io.Copy(io.Discard, pr)
	}
	pr.CloseWithError(errors.New("copy out: extraction ended")) // unblocks a provider still writing
	err := <-derr
	switch {
	case err != nil && (xerr == nil || errors.Is(xerr, err)):
		return res, err // the provider's failure, which the stream only passed on
	case xerr != nil:
		return res, xerr // the provider's error, if any, followed from it
	}
	return res, nil
}

// Extract writes the entries of the tar stream r into the host directory
// dst (made if missing), as the package doc says. It reads r to the end of
// the archive. Entries it will not write are listed in Result.Skipped (and
// given to Options.Warn) and are not an error; a malformed stream is a
// *MalformedError, and a host file system's failure is returned as it is.
func Extract(r io.Reader, dst string, o Options) (Result, error) {
	if err := os.MkdirAll(dst, 0o755); err != nil {
		return Result{}, fmt.Errorf("copy out: %w", err)
	}
	root, err := os.OpenRoot(dst)
	if err != nil {
		return Result{}, fmt.Errorf("copy out: %w", err)
	}
	defer root.Close()
	x := &extractor{dst: dst, root: root, o: o, mask: umask(), dirs: map[string]bool{".": true}, regs: map[string]bool{}, refused: map[string]bool{}}
	err = x.run(tar.NewReader(r))
	if ferr := x.finish(); err == nil {
		err = ferr
	}
	return x.res, err
}

type extractor struct {
	dst  string
	root *os.Root
	o    Options
	mask fs.FileMode
	res  Result
	// dirs are the names known to be real directories (not symlinks);
	// only this extraction changes dst, and it never replaces a
	// directory, so they stay so.
	dirs map[string]bool
	// regs are the regular files this extraction made, by name: the only
	// targets a hard link may have.
	regs map[string]bool
	// made are the directories it made, in order, with the mode and time
	// set when everything else is in place (so that a read-only directory
	// can be filled first).
	made []madeDir
	// links are the symlinks it made, checked at the end (a later entry
	// can change where an earlier link leads).
	links []string
	// refused are the symlinks it did not make: an entry beneath one is
	// refused too, not put in a directory of that name.
	refused map[string]bool
}

type madeDir struct {
	name  string
	mode  fs.FileMode
	mtime time.Time
}

func (x *extractor) skip(name, format string, args ...any) {
	s := Skipped{Name: name, Reason: fmt.Sprintf(format, args...)}
	x.res.Skipped = append(x.res.Skipped, s)
	if x.o.Warn != nil {
		x.o.Warn(s)
	}
}

func (x *extractor) run(tr *tar.Reader) error {
	for n := 0; ; n++ {
		h, err := tr.Next()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return &MalformedError{Dst: x.dst, Entries: n, Err: err}
		}
		if err := x.entry(tr, h); err != nil {
			var me *MalformedError
			if errors.As(err, &me) {
				me.Entries = n
			}
			return err
		}
	}
}

// cleanName is an entry's name relative to the destination, or ok false
// for one that is absolute or leads out of it.
func cleanName(n string) (name string, ok bool) {
	if n == "" || strings.IndexByte(n, 0) >= 0 || path.IsAbs(n) {
		return "", false
	}
	c := path.Clean(n)
	if c == "." {
		return c, true
	}
	return c, filepath.IsLocal(c)
}

func (x *extractor) entry(tr *tar.Reader, h *tar.Header) error {
	name, ok := cleanName(h.Name)
	if !ok {
		if path.IsAbs(h.Name) {
			x.skip(h.Name, "an absolute name")
		} else {
			x.skip(h.Name, "the name leads outside the destination")
		}
		return nil
	}
	switch h.Typeflag {
	case tar.TypeChar, tar.TypeBlock:
		x.skip(name, "a device node (%d, %d) is never made on the host", h.Devmajor, h.Devminor)
		return nil
	case tar.TypeFifo:
		x.skip(name, "a fifo is never made on the host")
		return nil
	case tar.TypeGNUSparse:
		x.skip(name, "a sparse file is not copied (its holes could hide any size)")
		return nil
	case tar.TypeDir, tar.TypeReg, tar.TypeSymlink, tar.TypeLink:
		if sparse(h) {
			x.skip(name, "a sparse file is not copied (its holes could hide any size)")
			return nil
		}
	default:
		x.skip(name, "an entry of tar type %q is not copied", h.Typeflag)
		return nil
	}
	if name == "." {
		if h.Typeflag != tar.TypeDir {
			x.skip(h.Name, "names the destination itself")
		}
		return nil // the destination keeps its own mode
	}
	if why := x.parents(name); why != "" {
		x.skip(name, "%s", why)
		return nil
	}
	existing, err := x.root.Lstat(name)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		existing = nil
	case err != nil:
		return fmt.Errorf("copy out into %s: %w", x.dst, err)
	}
	if h.Typeflag == tar.TypeDir {
		return x.dir(name, h, existing)
	}
	if existing != nil {
		if existing.IsDir() {
			x.skip(name, "a directory is there already")
			return nil
		}
		if err := x.root.Remove(name); err != nil {
			return fmt.Errorf("copy out into %s: replace %s: %w", x.dst, name, err)
		}
		delete(x.regs, name)
	}
	switch h.Typeflag {
	case tar.TypeSymlink:
		return x.symlink(name, h)
	case tar.TypeLink:
		return x.hardlink(name, h)
	}
	return x.file(tr, name, h)
}

// sparse: h is a file in one of GNU's sparse formats, whose data archive/tar
// expands, holes as zeros, to its logical size: a few bytes of stream for
// any number of bytes on the host. A provider's tar never makes one (GNU
// tar only with --sparse).
func sparse(h *tar.Header) bool {
	for k := range h.PAXRecords {
		if strings.HasPrefix(k, "GNU.sparse.") {
			return true
		}
	}
	return false
}

// parents makes sure every directory above name is a real directory,
// making missing ones; it returns why not when one is a symlink or not a
// directory.
func (x *extractor) parents(name string) string {
	for i := 0; i < len(name); i++ {
		if name[i] != '/' {
			continue
		}
		p := name[:i]
		if x.dirs[p] {
			continue
		}
		if x.refused[p] {
			return fmt.Sprintf("it goes through the symlink %s, which was not copied", p)
		}
		fi, err := x.root.Lstat(p)
		switch {
		case errors.Is(err, fs.ErrNotExist):
			if err := x.root.Mkdir(p, 0o755); err != nil {
				return fmt.Sprintf("cannot make its directory %s: %v", p, err)
			}
		case err != nil:
			return fmt.Sprintf("cannot look at its directory %s: %v", p, err)
		case fi.Mode()&fs.ModeSymlink != 0:
			return fmt.Sprintf("it goes through the symlink %s", p)
		case !fi.IsDir():
			return fmt.Sprintf("%s above it is not a directory", p)
		}
		x.dirs[p] = true
	}
	return ""
}

// noFollow: a name's last component is never followed (O_EXCL refuses an
// existing one already; this says it twice).
const noFollow = syscall.O_NOFOLLOW

// perm is the mode a file of mode m gets on the host: its permission bits
// less the umask, never setuid, setgid or sticky.
func (x *extractor) perm(m int64) fs.FileMode { return fs.FileMode(m) & fs.ModePerm &^ x.mask }

func (x *extractor) dir(name string, h *tar.Header, existing fs.FileInfo) error {
	if existing != nil && existing.IsDir() {
		x.dirs[name] = true // the host's or an earlier entry's: left as it is
		return nil
	}
	if existing != nil {
		if err := x.root.Remove(name); err != nil {
			return fmt.Errorf("copy out into %s: replace %s: %w", x.dst, name, err)
		}
		delete(x.regs, name)
	}
	if err := x.root.Mkdir(name, 0o700); err != nil {
		return fmt.Errorf("copy out into %s: %w", x.dst, err)
	}
	x.dirs[name] = true
	mode := x.perm(h.Mode)
	if h.Mode&0o1000 != 0 {
		mode |= fs.ModeSticky // harmless on a directory: only owners delete
	}
	x.made = append(x.made, madeDir{name: name, mode: mode, mtime: h.ModTime})
	x.res.Dirs++
	return nil
}

func (x *extractor) file(tr *tar.Reader, name string, h *tar.Header) error {
	f, err := x.root.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL|noFollow, 0o600)
	if err != nil {
		return fmt.Errorf("copy out into %s: %w", x.dst, err)
	}
	src := &streamReader{r: tr}
	n, err := io.Copy(f, src)
	x.res.Bytes += n
	if err != nil {
		f.Close()
		if src.err != nil {
			return &MalformedError{Dst: x.dst, Entry: name, Err: src.err}
		}
		return fmt.Errorf("copy out into %s: write %s: %w", x.dst, name, err)
	}
	if err := f.Chmod(x.perm(h.Mode)); err != nil {
		f.Close()
		return fmt.Errorf("copy out into %s: %w", x.dst, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("copy out into %s: %w", x.dst, err)
	}
	if !h.ModTime.IsZero() {
		_ = x.root.Chtimes(name, h.ModTime, h.ModTime) // a time is a nicety
	}
	x.regs[name] = true
	x.res.Files++
	return nil
}

// streamReader keeps the stream's read error, to tell it apart from the
// host file's write error in io.Copy.
type streamReader struct {
	r   io.Reader
	err error
}

func (s *streamReader) Read(b []byte) (int, error) {
	n, err := s.r.Read(b)
	if err != nil && err != io.EOF {
		s.err = err
	}
	return n, err
}

// escapesLexically: the symlink name → target leads out of the
// destination by its text alone.
func escapesLexically(name, target string) bool {
	if path.IsAbs(target) {
		return true
	}
	return !filepath.IsLocal(path.Join(path.Dir(name), target))
}

func (x *extractor) symlink(name string, h *tar.Header) error {
	if h.Linkname == "" {
		x.refused[name] = true
		x.skip(name, "a symlink to nothing")
		return nil
	}
	if escapesLexically(name, h.Linkname) {
		x.refused[name] = true
		x.skip(name, "a symlink to %q, outside the destination", h.Linkname)
		return nil
	}
	if err := x.root.Symlink(h.Linkname, name); err != nil {
		return fmt.Errorf("copy out into %s: %w", x.dst, err)
	}
	x.links = append(x.links, name)
	x.res.Symlinks++
	return nil
}

func (x *extractor) hardlink(name string, h *tar.Header) error {
	target, ok := cleanName(h.Linkname)
	if !ok || target == "." {
		x.skip(name, "a hard link to %q, outside the destination", h.Linkname)
		return nil
	}
	if !x.regs[target] {
		x.skip(name, "a hard link to %q, which is not a regular file copied before it", h.Linkname)
		return nil
	}
	if err := x.root.Link(target, name); err != nil {
		return fmt.Errorf("copy out into %s: %w", x.dst, err)
	}
	x.regs[name] = true
	x.res.Links++
	return nil
}

// finish removes the symlinks that, with everything in place, lead out of
// the destination by way of other links, and gives the directories made
// their modes and times, deepest first.
func (x *extractor) finish() error {
	var first error
	for _, l := range x.links {
		fi, err := x.root.Lstat(l)
		if err != nil || fi.Mode()&fs.ModeSymlink == 0 {
			continue // replaced by a later entry
		}
		if why := x.resolve(l); why != "" {
			target, _ := x.root.Readlink(l)
			if err := x.root.Remove(l); err != nil && first == nil {
				first = fmt.Errorf("copy out into %s: remove the symlink %s, which %s: %w", x.dst, l, why, err)
			}
			x.res.Symlinks--
			x.skip(l, "a symlink to %q, which %s", target, why)
		}
	}
	for _, d := range slices.Backward(x.made) {
		fi, err := x.root.Lstat(d.name)
		if err != nil || !fi.IsDir() {
			continue
		}
		if !d.mtime.IsZero() {
			_ = x.root.Chtimes(d.name, d.mtime, d.mtime)
		}
		if err := x.root.Chmod(d.name, d.mode); err != nil && first == nil {
			first = fmt.Errorf("copy out into %s: %w", x.dst, err)
		}
	}
	return first
}

// maxHops bounds the symlinks followed in resolving one (Linux's own
// limit).
const maxHops = 40

// resolve follows the symlink name within the destination as the kernel
// would, component by component; it says why not when the link leads out
// of it or loops. A component that is missing (the link dangles) is taken
// as a directory.
func (x *extractor) resolve(name string) string {
	var cur []string // the real directories reached so far
	rest := strings.Split(name, "/")
	for hops := 0; len(rest) > 0; {
		c := rest[0]
		rest = rest[1:]
		switch c {
		case "", ".":
			continue
		case "..":
			if len(cur) == 0 {
				return "leads outside the destination"
			}
			cur = cur[:len(cur)-1]
			continue
		}
		p := path.Join(append(slices.Clone(cur), c)...)
		fi, err := x.root.Lstat(p)
		if err != nil || fi.Mode()&fs.ModeSymlink == 0 {
			cur = append(cur, c)
			continue
		}
		if hops++; hops > maxHops {
			return "leads through too many symlinks (a loop)"
		}
		t, err := x.root.Readlink(p)
		if err != nil {
			return fmt.Sprintf("cannot be read: %v", err)
		}
		if path.IsAbs(t) {
			return fmt.Sprintf("leads outside the destination (by way of %s)", p)
		}
		rest = append(strings.Split(t, "/"), rest...)
	}
	return ""
}

var (
	umaskOnce sync.Once
	umaskVal  fs.FileMode
)

// umask is the process's file mode creation mask, read from
// /proc/self/status (setting it to read it would race with other
// goroutines' file creation); 022 when it cannot be read.
func umask() fs.FileMode {
	umaskOnce.Do(func() {
		umaskVal = 0o022
		f, err := os.Open("/proc/self/status")
		if err != nil {
			return
		}
		defer f.Close()
		s := bufio.NewScanner(f)
		for s.Scan() {
			if v, ok := strings.CutPrefix(s.Text(), "Umask:"); ok {
				if m, err := strconv.ParseUint(strings.TrimSpace(v), 8, 32); err == nil {
					umaskVal = fs.FileMode(m) & fs.ModePerm
				}
				return
			}
		}
	})
	return umaskVal
}
