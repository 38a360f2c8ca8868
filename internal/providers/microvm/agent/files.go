package agent

import (
	"archive/tar"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"os"
	"strconv"
	"strings"
	"syscall"

	"stasis/errdefs"
	"stasis/internal/fileop"
	"stasis/sandbox"
)

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
		return "", sandbox.Errorf(errdefs.ErrInvalid, op, "", "no %s given", name)
	}
	if strings.IndexByte(p, 0) >= 0 {
		return "", sandbox.Errorf(errdefs.ErrInvalid, op, "", "the %s holds a NUL byte", name)
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
		return nil, sandbox.Errorf(errdefs.ErrNotFound, "read", "", "no file %s", p)
	}
	if err != nil {
		return nil, err
	}
	fi, err := f.Stat()
	if err == nil && fi.IsDir() {
		err = sandbox.Errorf(errdefs.ErrNotFound, "read", "", "%s is a directory", p)
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
			err = sandbox.Errorf(errdefs.ErrInvalid, "write", "", "bad mode %q (octal, at most 07777)", r.URL.Query().Get("mode"))
		} else if err = s.asAgent(func() error { return writeFile(p, r.Body, fileMode(uint32(mode))) }); err == nil {
			w.WriteHeader(http.StatusNoContent)
			return
		}
	}
	drainBody(r)
	writeError(w, err)
}

// writeFile writes a file atomically (fileop.Write); what the caller got
// wrong (a directory in the way, a path it cannot make) is invalid.
func writeFile(p string, data io.Reader, mode fs.FileMode) error {
	err := fileop.Write(p, data, mode)
	if errors.Is(err, fileop.ErrInvalid) {
		return sandbox.Errorf(errdefs.ErrInvalid, "write", "", "%v", err)
	}
	return err
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

// extract reads a tar stream into dir (fileop.Unpack: through an os.Root,
// which refuses any path that would lead out of dir, symlinks included).
func (s *server) extract(dir string, body io.Reader) error {
	err := fileop.Unpack(dir, body, func(h *tar.Header) {
		s.log.Debug("upload: entry skipped", "name", h.Name, "type", string(h.Typeflag))
	})
	if err != nil {
		return sandbox.Errorf(errdefs.ErrInvalid, "upload", "", "into %s: %v", dir, err)
	}
	return nil
}

func (s *server) download(w http.ResponseWriter, r *http.Request) {
	dir, err := queryPath(r, "download", "dir")
	if err == nil {
		var fi fs.FileInfo
		fi, err = os.Stat(dir)
		switch {
		case errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENOTDIR):
			err = sandbox.Errorf(errdefs.ErrNotFound, "download", "", "no directory %s", dir)
		case err == nil && !fi.IsDir():
			err = sandbox.Errorf(errdefs.ErrNotFound, "download", "", "%s is not a directory", dir)
		}
	}
	if err != nil {
		writeError(w, err)
		return
	}
	w.Header().Set("Content-Type", "application/x-tar")
	w.Header().Set("Trailer", errTrailer)
	w.WriteHeader(http.StatusOK)
	if err := fileop.Pack(dir, w); err != nil {
		s.log.Warn("download failed", "dir", dir, "err", err)
		setTrailerError(w, err)
	}
}
