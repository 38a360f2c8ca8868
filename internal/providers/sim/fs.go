package sim

import (
	"archive/tar"
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"time"
	"unique"
)

// entry is one file or directory of a simulated sandbox. A file's content
// is interned: the same bytes in many sandboxes (a task's tree in every
// episode of it, a fork's files) are held once.
type entry struct {
	mode  fs.FileMode // with fs.ModeDir for a directory
	data  unique.Handle[string]
	mtime time.Time
}

func (e entry) isDir() bool { return e.mode.IsDir() }

// files is a sandbox's file system: clean absolute path → entry. It is not
// safe for concurrent use; the sandbox's lock guards it. A snapshot copies
// the map (the contents are shared, immutable).
type files map[string]entry

// newFiles is a fresh sandbox's tree: the directories every sandbox has.
func newFiles(now time.Time) files {
	f := files{}
	for _, d := range []string{"/", "/work", "/tmp", "/root", "/stasis", "/stasis/bin"} {
		f[d] = entry{mode: fs.ModeDir | 0o755, mtime: now}
	}
	f["/tmp"] = entry{mode: fs.ModeDir | fs.ModeSticky | 0o777, mtime: now}
	return f
}

// clean makes p absolute (relative to dir) and clean.
func clean(dir, p string) string {
	if !path.IsAbs(p) {
		p = path.Join(dir, p)
	}
	return path.Clean(p)
}

func pathErr(op, p string, err error) error { return &fs.PathError{Op: op, Path: p, Err: err} }

// read returns a file's content.
func (f files) read(p string) ([]byte, error) {
	e, ok := f[p]
	switch {
	case !ok:
		return nil, pathErr("open", p, fs.ErrNotExist)
	case e.isDir():
		return nil, pathErr("read", p, errors.New("is a directory"))
	}
	return []byte(e.data.Value()), nil
}

// parentOK checks that p's directory exists.
func (f files) parentOK(p string) error {
	d := path.Dir(p)
	e, ok := f[d]
	switch {
	case !ok:
		return pathErr("open", p, fs.ErrNotExist)
	case !e.isDir():
		return pathErr("open", p, errors.New("not a directory"))
	}
	return nil
}

// write makes or replaces a file; its directory must exist.
func (f files) write(p string, data []byte, mode fs.FileMode, now time.Time) error {
	if e, ok := f[p]; ok && e.isDir() {
		return pathErr("open", p, errors.New("is a directory"))
	}
	if err := f.parentOK(p); err != nil {
		return err
	}
	f[p] = entry{mode: mode.Perm(), data: unique.Make(string(data)), mtime: now}
	return nil
}

// mkdirAll makes p and its parents.
func (f files) mkdirAll(p string, mode fs.FileMode, now time.Time) error {
	if e, ok := f[p]; ok {
		if !e.isDir() {
			return pathErr("mkdir", p, errors.New("not a directory"))
		}
		return nil
	}
	if p != "/" {
		if err := f.mkdirAll(path.Dir(p), mode, now); err != nil {
			return err
		}
	}
	f[p] = entry{mode: fs.ModeDir | mode.Perm(), mtime: now}
	return nil
}

// children lists the names directly below directory p, sorted.
func (f files) children(p string) []string {
	prefix := p + "/"
	if p == "/" {
		prefix = "/"
	}
	var out []string
	for k := range f {
		if k != p && strings.HasPrefix(k, prefix) && !strings.Contains(k[len(prefix):], "/") {
			out = append(out, k[len(prefix):])
		}
	}
	slices.Sort(out)
	return out
}

// below lists p and everything under it.
func (f files) below(p string) []string {
	var out []string
	for k := range f {
		if k == p || p == "/" || strings.HasPrefix(k, p+"/") {
			out = append(out, k)
		}
	}
	slices.Sort(out)
	return out
}

// remove removes p (with everything under it when recursive).
func (f files) remove(p string, recursive bool) error {
	e, ok := f[p]
	if !ok {
		return pathErr("remove", p, fs.ErrNotExist)
	}
	if p == "/" {
		return pathErr("remove", p, errors.New("refusing to remove /"))
	}
	if e.isDir() && len(f.children(p)) > 0 && !recursive {
		return pathErr("remove", p, errors.New("directory not empty"))
	}
	for _, k := range f.below(p) {
		delete(f, k)
	}
	return nil
}

// rename moves src (and what is under it) to dst.
func (f files) rename(src, dst string) error {
	if _, ok := f[src]; !ok {
		return pathErr("rename", src, fs.ErrNotExist)
	}
	if err := f.parentOK(dst); err != nil {
		return err
	}
	if e, ok := f[dst]; ok && e.isDir() {
		return pathErr("rename", dst, errors.New("is a directory"))
	}
	moved := map[string]entry{}
	for _, k := range f.below(src) {
		moved[dst+strings.TrimPrefix(k, src)] = f[k]
		delete(f, k)
	}
	maps.Copy(f, moved)
	return nil
}

// seedFrom copies a host directory's tree into the sandbox at dir.
func (f files) seedFrom(host, dir string, now time.Time) error {
	return filepath.WalkDir(host, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(host, p)
		if err != nil {
			return err
		}
		target := path.Join(dir, filepath.ToSlash(rel))
		info, err := d.Info()
		if err != nil {
			return err
		}
		switch {
		case d.IsDir():
			return f.mkdirAll(target, info.Mode().Perm(), now)
		case info.Mode().IsRegular():
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			return f.write(target, b, info.Mode().Perm(), info.ModTime())
		}
		return nil // links and devices: not in a simulated sandbox
	})
}

// untar extracts a tar stream into dir.
func (f files) untar(dir string, r io.Reader, now time.Time) error {
	if err := f.mkdirAll(dir, 0o755, now); err != nil {
		return err
	}
	tr := tar.NewReader(r)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
		name := path.Clean("/" + h.Name)
		target := path.Join(dir, name)
		switch h.Typeflag {
		case tar.TypeDir:
			if err := f.mkdirAll(target, fs.FileMode(h.Mode).Perm(), now); err != nil {
				return err
			}
		case tar.TypeReg:
			if err := f.mkdirAll(path.Dir(target), 0o755, now); err != nil {
				return err
			}
			b, err := io.ReadAll(tr)
			if err != nil {
				return err
			}
			if err := f.write(target, b, fs.FileMode(h.Mode).Perm(), h.ModTime); err != nil {
				return err
			}
		default:
			return fmt.Errorf("%s: tar entry type %q: a simulated sandbox holds files and directories only", h.Name, h.Typeflag)
		}
	}
}

// tar writes dir as a tar stream, names relative to it.
func (f files) tar(dir string, w io.Writer) error {
	e, ok := f[dir]
	if !ok {
		return pathErr("open", dir, fs.ErrNotExist)
	}
	if !e.isDir() {
		return pathErr("open", dir, errors.New("not a directory"))
	}
	tw := tar.NewWriter(w)
	for _, k := range f.below(dir) {
		if k == dir {
			continue
		}
		e := f[k]
		name := strings.TrimPrefix(strings.TrimPrefix(k, dir), "/")
		h := &tar.Header{Name: name, Mode: int64(e.mode.Perm()), ModTime: e.mtime, Typeflag: tar.TypeReg}
		var body []byte
		if e.isDir() {
			h.Name += "/"
			h.Typeflag = tar.TypeDir
		} else {
			body = []byte(e.data.Value())
			h.Size = int64(len(body))
		}
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if _, err := tw.Write(body); err != nil {
			return err
		}
	}
	return tw.Close()
}

// fileInfo is an entry as fs.FileInfo, for the shell's tests.
type fileInfo struct {
	name string
	e    entry
}

func (i fileInfo) Name() string       { return i.name }
func (i fileInfo) Size() int64        { return int64(len(i.e.data.Value())) }
func (i fileInfo) Mode() fs.FileMode  { return i.e.mode }
func (i fileInfo) ModTime() time.Time { return i.e.mtime }
func (i fileInfo) IsDir() bool        { return i.e.isDir() }
func (i fileInfo) Sys() any           { return nil }

// openFile is a file the shell opened: reads from its content at open,
// writes into a buffer that replaces (or extends) the file at Close.
type openFile struct {
	r      *bytes.Reader
	w      *bytes.Buffer
	commit func([]byte) error
}

func (o *openFile) Read(p []byte) (int, error) {
	if o.r == nil {
		return 0, errors.New("file not open for reading")
	}
	return o.r.Read(p)
}

func (o *openFile) Write(p []byte) (int, error) {
	if o.w == nil {
		return 0, errors.New("file not open for writing")
	}
	return o.w.Write(p)
}

func (o *openFile) Close() error {
	if o.w == nil || o.commit == nil {
		return nil
	}
	c := o.commit
	o.commit = nil
	return c(o.w.Bytes())
}

// discard is /dev/null.
type discard struct{}

func (discard) Read([]byte) (int, error)    { return 0, io.EOF }
func (discard) Write(p []byte) (int, error) { return len(p), nil }
func (discard) Close() error                { return nil }
