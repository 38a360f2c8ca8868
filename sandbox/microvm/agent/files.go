package agent

import (
	"archive/tar"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"stasis/sandbox"
)

// specialBits are the mode bits beyond the permissions that a mode may set.
const specialBits = fs.ModeSetuid | fs.ModeSetgid | fs.ModeSticky

// unixMode turns a FileMode's permission and special bits into the octal
// number the wire carries, and fileMode turns it back.
func unixMode(m fs.FileMode) uint32 {
	u := uint32(m.Perm())
	if m&fs.ModeSetuid != 0 {
		u |= 0o4000
	}
	if m&fs.ModeSetgid != 0 {
		u |= 0o2000
	}
	if m&fs.ModeSticky != 0 {
		u |= 0o1000
	}
	return u
}

func fileMode(u uint32) fs.FileMode {
	m := fs.FileMode(u & 0o777)
	if u&0o4000 != 0 {
		m |= fs.ModeSetuid
	}
	if u&0o2000 != 0 {
		m |= fs.ModeSetgid
	}
	if u&0o1000 != 0 {
		m |= fs.ModeSticky
	}
	return m
}

// queryPath reads a path parameter, made absolute and clean.
func queryPath(r *http.Request, op, name string) (string, error) {
	p := r.URL.Query().Get(name)
	if p == "" {
		return "", sandbox.Errorf(sandbox.ErrInvalid, op, "", "no %s given", name)
	}
	if strings.IndexByte(p, 0) >= 0 {
		return "", sandbox.Errorf(sandbox.ErrInvalid, op, "", "the %s holds a NUL byte", name)
	}
	return absPath(p), nil
}

func (s *server) readFile(w http.ResponseWriter, r *http.Request) {
	p, err := queryPath(r, "read", "path")
	var f *os.File
	if err == nil {
		f, err = openFile(p)
	}
	if err != nil {
		writeError(w, err)
		return
	}
	defer f.Close()
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Trailer", errTrailer)
	if _, err := io.Copy(w, f); err != nil {
		s.log.Warn("read failed", "path", p, "err", err)
		setTrailerError(w, fmt.Errorf("read %s: %w", p, err))
	}
}

// openFile opens a file to read; a missing one, or a directory, is not
// found (as the local provider has it).
func openFile(p string) (*os.File, error) {
	f, err := os.Open(p)
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENOTDIR) {
		return nil, sandbox.Errorf(sandbox.ErrNotFound, "read", "", "no file %s", p)
	}
	if err != nil {
		return nil, err
	}
	fi, err := f.Stat()
	if err == nil && fi.IsDir() {
		err = sandbox.Errorf(sandbox.ErrNotFound, "read", "", "%s is a directory", p)
	}
	if err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// setTrailerError reports an error that came after the response began.
func setTrailerError(w http.ResponseWriter, err error) {
	w.Header().Set(errTrailer, strings.NewReplacer("\r", " ", "\n", " ").Replace(err.Error()))
}

func (s *server) writeFile(w http.ResponseWriter, r *http.Request) {
	p, err := queryPath(r, "write", "path")
	if err == nil {
		var mode uint64
		mode, err = strconv.ParseUint(r.URL.Query().Get("mode"), 8, 32)
		if err != nil || mode > 0o7777 {
			err = sandbox.Errorf(sandbox.ErrInvalid, "write", "", "bad mode %q (octal, at most 07777)", r.URL.Query().Get("mode"))
		} else if err = s.asAgent(func() error { return writeFile(p, r.Body, fileMode(uint32(mode))) }); err == nil {
			w.WriteHeader(http.StatusNoContent)
			return
		}
	}
	drainBody(r)
	writeError(w, err)
}

// writeFile writes a file atomically: a temporary file beside it, renamed
// over it. A symlink at p writes the file it points to.
func writeFile(p string, data io.Reader, mode fs.FileMode) error {
	invalid := func(format string, args ...any) error {
		return sandbox.Errorf(sandbox.ErrInvalid, "write", "", format, args...)
	}
	target, err := followLinks(p)
	if err != nil {
		return invalid("%s: %v", p, err)
	}
	if target == "/" {
		return invalid("%s is a directory", p)
	}
	dir := filepath.Dir(target)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return invalid("%s: %v", p, err)
	}
	if fi, err := os.Lstat(target); err == nil && fi.IsDir() {
		return invalid("%s is a directory", p)
	}
	base := filepath.Base(target)
	if len(base) > 100 { // room for the suffix within NAME_MAX
		base = base[:100]
	}
	f, err := os.CreateTemp(dir, "."+base+".stasis-*")
	if err != nil {
		return invalid("%s: %v", p, err)
	}
	_, err = io.Copy(f, data)
	if err == nil {
		err = f.Chmod(mode)
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(f.Name(), target)
	}
	if err != nil {
		_ = os.Remove(f.Name())
		return fmt.Errorf("write %s: %w", p, err)
	}
	return nil
}

// followLinks resolves symlinks in the last element of p, as open(2) would.
func followLinks(p string) (string, error) {
	for range 40 {
		fi, err := os.Lstat(p)
		if err != nil || fi.Mode()&fs.ModeSymlink == 0 {
			return p, nil
		}
		link, err := os.Readlink(p)
		if err != nil {
			return "", err
		}
		if !filepath.IsAbs(link) {
			link = filepath.Join(filepath.Dir(p), link)
		}
		p = filepath.Clean(link)
	}
	return "", syscall.ELOOP
}

func (s *server) upload(w http.ResponseWriter, r *http.Request) {
	dir, err := queryPath(r, "upload", "dir")
	if err == nil {
		if err = s.asAgent(func() error { return s.extract(dir, r.Body) }); err == nil {
			w.WriteHeader(http.StatusNoContent)
			return
		}
	}
	drainBody(r)
	writeError(w, err)
}

// entryName checks a tar entry's name (or a hard link's target) and
// returns it clean and relative to the extraction directory ("." for the
// directory itself).
func entryName(name string) (string, error) {
	if name == "" {
		return "", errors.New("empty name")
	}
	if strings.HasPrefix(name, "/") {
		return "", errors.New("absolute path")
	}
	for _, el := range strings.Split(name, "/") {
		if el == ".." {
			return "", errors.New(`".." in the path`)
		}
	}
	return path.Clean(name), nil
}

// dirTimes is a directory whose mode and time are set after every entry is
// in (an entry written into it would change its time again).
type dirTimes struct {
	name  string
	mode  fs.FileMode
	mtime time.Time
}

// extract reads a tar stream into dir through an os.Root, which refuses any
// path that would lead out of dir, symlinks included.
func (s *server) extract(dir string, body io.Reader) error {
	invalid := func(format string, args ...any) error {
		return sandbox.Errorf(sandbox.ErrInvalid, "upload", "", format, args...)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return invalid("into %s: %v", dir, err)
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		return invalid("into %s: %v", dir, err)
	}
	defer root.Close()
	var dirs []dirTimes
	tr := tar.NewReader(body)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return invalid("into %s: bad tar stream: %v", dir, err)
		}
		if err := s.extractEntry(root, tr, h, &dirs); err != nil {
			if strings.Contains(err.Error(), "path escapes") { // os.Root's error
				return invalid("into %s: entry %q leads out of the directory through a symlink (%v)", dir, h.Name, err)
			}
			return invalid("into %s: entry %q: %v", dir, h.Name, err)
		}
	}
	for i := len(dirs) - 1; i >= 0; i-- {
		d := dirs[i]
		if err := root.Chmod(d.name, d.mode); err != nil {
			return invalid("into %s: %v", dir, err)
		}
		if err := root.Chtimes(d.name, d.mtime, d.mtime); err != nil {
			return invalid("into %s: %v", dir, err)
		}
	}
	return nil
}

func (s *server) extractEntry(root *os.Root, tr *tar.Reader, h *tar.Header, dirs *[]dirTimes) error {
	name, err := entryName(h.Name)
	if err != nil {
		return err
	}
	mode := h.FileInfo().Mode() & (fs.ModePerm | specialBits)
	if parent := path.Dir(name); parent != "." {
		if err := root.MkdirAll(parent, 0o755); err != nil {
			return err
		}
	}
	switch h.Typeflag {
	case tar.TypeDir:
		if fi, err := root.Lstat(name); err == nil && !fi.IsDir() {
			if err := root.Remove(name); err != nil {
				return err
			}
		}
		if err := root.Mkdir(name, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
			return err
		}
		*dirs = append(*dirs, dirTimes{name, mode, h.ModTime})
		return nil
	case tar.TypeReg:
		if err := replaceable(root, name); err != nil {
			return err
		}
		f, err := root.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
		if err != nil {
			return err
		}
		_, err = io.Copy(f, tr)
		if err == nil {
			err = f.Chmod(mode)
		}
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return err
		}
		return root.Chtimes(name, h.ModTime, h.ModTime)
	case tar.TypeSymlink:
		if err := replaceable(root, name); err != nil {
			return err
		}
		return root.Symlink(h.Linkname, name)
	case tar.TypeLink:
		target, err := entryName(h.Linkname)
		if err != nil {
			return fmt.Errorf("link target %q: %v", h.Linkname, err)
		}
		if target == name {
			return nil // a link to itself: the file is already there
		}
		if err := replaceable(root, name); err != nil {
			return err
		}
		return root.Link(target, name)
	}
	s.log.Debug("upload: entry skipped", "name", h.Name, "type", string(h.Typeflag))
	return nil
}

// replaceable removes what is at name unless it is a directory (which
// stays, and makes the entry fail).
func replaceable(root *os.Root, name string) error {
	fi, err := root.Lstat(name)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if fi.IsDir() {
		return errors.New("a directory is in the way")
	}
	return root.Remove(name)
}

func (s *server) download(w http.ResponseWriter, r *http.Request) {
	dir, err := queryPath(r, "download", "dir")
	if err == nil {
		var fi fs.FileInfo
		fi, err = os.Stat(dir)
		switch {
		case errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENOTDIR):
			err = sandbox.Errorf(sandbox.ErrNotFound, "download", "", "no directory %s", dir)
		case err == nil && !fi.IsDir():
			err = sandbox.Errorf(sandbox.ErrNotFound, "download", "", "%s is not a directory", dir)
		}
	}
	if err != nil {
		writeError(w, err)
		return
	}
	w.Header().Set("Content-Type", "application/x-tar")
	w.Header().Set("Trailer", errTrailer)
	w.WriteHeader(http.StatusOK)
	if err := writeTar(w, dir); err != nil {
		s.log.Warn("download failed", "dir", dir, "err", err)
		setTrailerError(w, err)
	}
}

// writeTar writes dir as a tar stream: "./" and then "./name" for everything
// under it, symlinks not followed, hard links kept.
func writeTar(w io.Writer, dir string) error {
	tw := tar.NewWriter(w)
	type inode struct{ dev, ino uint64 }
	seen := map[inode]string{}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) && p != dir {
				return nil // gone since the directory was listed
			}
			return err
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil {
			return err
		}
		name := "./"
		if rel != "." {
			name += filepath.ToSlash(rel)
		}
		fi, err := d.Info()
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		if err != nil {
			return err
		}
		link := ""
		if fi.Mode()&fs.ModeSymlink != 0 {
			if link, err = os.Readlink(p); err != nil {
				return err
			}
		}
		h, err := tar.FileInfoHeader(fi, link)
		if err != nil {
			return nil // a socket or another kind tar cannot hold
		}
		h.Name, h.Format = name, tar.FormatPAX
		h.AccessTime, h.ChangeTime = time.Time{}, time.Time{}
		if fi.IsDir() && rel != "." {
			h.Name += "/"
		}
		if st, ok := fi.Sys().(*syscall.Stat_t); ok && fi.Mode().IsRegular() && st.Nlink > 1 {
			key := inode{uint64(st.Dev), st.Ino}
			if first, ok := seen[key]; ok {
				h.Typeflag, h.Linkname, h.Size = tar.TypeLink, first, 0
			} else {
				seen[key] = name
			}
		}
		if h.Typeflag != tar.TypeReg {
			return tw.WriteHeader(h)
		}
		f, err := os.Open(p)
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		if err != nil {
			return err
		}
		defer f.Close()
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if _, err := io.CopyN(tw, f, h.Size); err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
		return nil
	})
	if err != nil {
		return err
	}
	return tw.Close()
}
