// Package vmstate owns the one thing stasis needs to know about QEMU's
// migration stream: where to cut it into chunks so that two saves of the
// same VM share what did not change.
//
// A Splitter reads a stream as QEMU writes it (QEMU 7.2's precopy format,
// "QEVM" version 3) and cuts it between RAM page records, by guest address:
// the records of one aligned group of guest pages (GroupBytes of one RAM
// block) make one chunk, so a chunk changes only when a page of its group
// does, and no rolling hash runs over the bytes. Groups holding mostly
// zero pages (nine bytes each in the stream) are merged until a chunk
// reaches MinChunk. The framing between the stream's RAM sections (an
// end-of-section mark, a footer, the next section's header) is a small
// chunk of its own, since where QEMU breaks its sections depends on
// timing.
//
// Cutting never changes the bytes: the chunks, in order, are exactly the
// stream. What is not understood is not guessed at: from the first
// section that is not RAM (the device state, saved after the memory), or
// from anything unexpected, the rest of the stream is cut every OpaqueChunk
// bytes. Parsed reports how far the parse went.
package vmstate

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
)

// Stream constants of QEMU's migration format (migration/savevm.c and
// migration/ram.c of QEMU 7.2).
const (
	fileMagic   = 0x5145564d // "QEVM"
	fileVersion = 3

	secStart    = 0x01
	secPart     = 0x02
	secEnd      = 0x03
	secFull     = 0x04
	secConfig   = 0x07
	secFooter   = 0x7e
	secEOF      = 0x1f
	subsection  = 0x05
	pageSize    = 4096 // TARGET_PAGE_SIZE on x86
	flagMask    = pageSize - 1
	flagZero    = 0x02
	flagMemSize = 0x04
	flagPage    = 0x08
	flagEOS     = 0x10
	flagCont    = 0x20
)

// Sizes of the cuts.
const (
	// GroupBytes is the span of guest memory whose pages make one chunk:
	// 64 pages, a chunk of at most about 256 KiB. (128 KiB stored 25% less
	// for a second save of a busy guest, in twice the blobs.)
	GroupBytes = 256 << 10
	// MinChunk: a group boundary is not cut before a chunk has this many
	// bytes (zero pages cost nine bytes each).
	MinChunk = 16 << 10
	// MaxChunk bounds any chunk.
	MaxChunk = 1 << 20
	// OpaqueChunk is the size of the chunks past the parsed part.
	OpaqueChunk = 256 << 10
)

// Splitter cuts a migration stream into chunks. It is not safe for
// concurrent use.
type Splitter struct {
	r *bufio.Reader
	// data is the stream when it is in memory (NewBytesSplitter,
	// NewGrowingSplitter; r is nil then): chunks are slices of it, pos is
	// how far it was read, start where the current chunk began, avail
	// how much of it is written (grow says more, when it is growing).
	data              []byte
	pos, start, avail int
	grow              func(need int) int
	// cur is the chunk being assembled; it is handed out by Next.
	cur []byte
	// out holds a finished chunk waiting to be handed out, when a cut
	// came in the middle of reading a record.
	out [][]byte

	blocks   map[string]uint64 // RAM block lengths, by name
	ramID    uint32            // the "ram" section's id, once seen
	haveRAM  bool
	curBlock string
	group    int64 // index of the group the last page belonged to; -1 none
	framing  bool  // cur holds only framing since the last page

	started bool
	opaque  bool
	why     string
	pages   int64
	err     error
}

// NewSplitter returns a Splitter reading the stream from r.
func NewSplitter(r io.Reader) *Splitter {
	return &Splitter{r: bufio.NewReaderSize(r, 256<<10), blocks: map[string]uint64{}, group: -1}
}

// NewBytesSplitter returns a Splitter over a whole stream in memory (a
// mapped file, say). It copies nothing: every chunk is a slice of data,
// which must not change while the chunks are in use.
func NewBytesSplitter(data []byte) *Splitter {
	return &Splitter{data: data, avail: len(data), cur: data[:0], blocks: map[string]uint64{}, group: -1}
}

// NewGrowingSplitter returns a Splitter over a stream still being written
// into data (a mapping of the file its producer writes, say), copying
// nothing, as NewBytesSplitter does. avail(need) returns how many bytes
// at the start of data are written, once at least need are or once no
// more will come; the Splitter reads no further.
func NewGrowingSplitter(data []byte, avail func(need int) int) *Splitter {
	return &Splitter{data: data, grow: avail, cur: data[:0], blocks: map[string]uint64{}, group: -1}
}

// ensure reports whether the first need bytes of an in-memory stream are
// there, waiting for them if it grows.
func (s *Splitter) ensure(need int) bool {
	if need > s.avail && s.grow != nil {
		s.avail = min(max(s.grow(need), s.avail), len(s.data))
	}
	return need <= s.avail
}

// Parsed reports whether the stream's RAM part was understood (every
// page record until the first non-RAM section) and, if not, why the
// splitter fell back to fixed-size cuts; pages counts the page records
// cut by address.
func (s *Splitter) Parsed() (ok bool, why string, pages int64) {
	return s.why == "" || s.why == reasonDevices, s.why, s.pages
}

const reasonDevices = "the device state (not RAM) follows"

// Next returns the next chunk, or io.EOF after the last. The chunk is the
// caller's: the Splitter does not touch it again.
func (s *Splitter) Next() ([]byte, error) {
	for len(s.out) == 0 {
		if s.err != nil {
			if len(s.cur) > 0 {
				s.emit()
				continue
			}
			return nil, s.err
		}
		s.step()
	}
	c := s.out[0]
	s.out[0] = nil
	s.out = s.out[1:]
	return c, nil
}

// emit finishes the current chunk.
func (s *Splitter) emit() {
	if len(s.cur) == 0 {
		return
	}
	s.out = append(s.out, s.cur)
	if s.r == nil {
		s.start = s.pos
		s.cur = s.data[s.pos:s.pos]
	} else {
		s.cur = make([]byte, 0, GroupBytes+GroupBytes/64)
	}
	s.framing = false
}

// fail ends parsing: the rest of the stream is cut at fixed sizes.
func (s *Splitter) fail(why string) {
	if !s.opaque {
		s.opaque, s.why = true, why
		s.emit()
	}
}

// step reads one record (or one opaque chunk) and cuts where it must.
func (s *Splitter) step() {
	if s.opaque {
		s.readOpaque()
		return
	}
	if len(s.cur) >= MaxChunk {
		s.emit()
	}
	if !s.started {
		s.started = true
		s.header()
		return
	}
	s.record()
}

func (s *Splitter) readOpaque() {
	if len(s.cur) > 0 {
		s.emit()
		return
	}
	if s.r == nil {
		whole := s.ensure(s.pos + OpaqueChunk)
		s.take(min(OpaqueChunk, s.avail-s.pos))
		s.emit()
		if !whole {
			s.err = io.EOF
		}
		return
	}
	buf := make([]byte, OpaqueChunk)
	n, err := io.ReadFull(s.r, buf)
	if n > 0 {
		s.cur = buf[:n]
		s.emit()
	}
	s.setErr(err)
}

func (s *Splitter) setErr(err error) {
	if err == nil {
		return
	}
	// What a Peek saw before the end is part of the stream too.
	if s.r == nil {
		s.pos = s.avail
		s.cur = s.data[s.start:s.pos]
	} else if n := s.r.Buffered(); n > 0 {
		b, _ := s.peek(n)
		s.cur = append(s.cur, b...)
		_, _ = s.r.Discard(n)
	}
	switch {
	case err == nil:
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		s.err = io.EOF
	default:
		s.err = err
	}
}

// peek returns the next n bytes without reading them.
func (s *Splitter) peek(n int) ([]byte, error) {
	if s.r != nil {
		return s.r.Peek(n)
	}
	if !s.ensure(s.pos + n) {
		return s.data[s.pos:s.avail], io.EOF
	}
	return s.data[s.pos : s.pos+n], nil
}

// take reads n bytes into the current chunk and returns them.
func (s *Splitter) take(n int) ([]byte, bool) {
	if s.r == nil {
		if !s.ensure(s.pos + n) {
			s.setErr(io.ErrUnexpectedEOF)
			return nil, false
		}
		s.pos += n
		s.cur = s.data[s.start:s.pos]
		return s.data[s.pos-n : s.pos], true
	}
	at := len(s.cur)
	if cap(s.cur)-at < n {
		c := make([]byte, at, 2*cap(s.cur)+n)
		copy(c, s.cur)
		s.cur = c
	}
	s.cur = s.cur[:at+n]
	m, err := io.ReadFull(s.r, s.cur[at:])
	if err != nil {
		s.cur = s.cur[:at+m]
		s.setErr(err)
		return nil, false
	}
	return s.cur[at:], true
}

func (s *Splitter) u8() (byte, bool) {
	b, ok := s.take(1)
	if !ok {
		return 0, false
	}
	return b[0], true
}

func (s *Splitter) be32() (uint32, bool) {
	b, ok := s.take(4)
	if !ok {
		return 0, false
	}
	return binary.BigEndian.Uint32(b), true
}

func (s *Splitter) be64() (uint64, bool) {
	b, ok := s.take(8)
	if !ok {
		return 0, false
	}
	return binary.BigEndian.Uint64(b), true
}

func (s *Splitter) str() (string, bool) {
	n, ok := s.u8()
	if !ok {
		return "", false
	}
	b, ok := s.take(int(n))
	return string(b), ok
}

// header reads the file header, the configuration section and the RAM
// section's header.
func (s *Splitter) header() {
	magic, ok := s.be32()
	if !ok {
		return
	}
	ver, ok := s.be32()
	if !ok {
		return
	}
	if magic != fileMagic || ver != fileVersion {
		s.fail(fmt.Sprintf("not a QEMU migration stream of version %d (magic %#x, version %d)", fileVersion, magic, ver))
		return
	}
	t, err := s.peek(1)
	if err != nil {
		s.setErr(err)
		return
	}
	if t[0] == secConfig {
		s.take(1)
		n, ok := s.be32()
		if !ok {
			return
		}
		if n > 256 {
			s.fail("configuration section too long")
			return
		}
		if _, ok := s.take(int(n)); !ok {
			return
		}
		if t, err := s.peek(1); err == nil && t[0] == subsection {
			s.fail("configuration subsections")
			return
		}
	}
	s.section()
}

// section reads a section header; only the RAM section's are parsed on.
func (s *Splitter) section() {
	b, err := s.peek(1)
	if err != nil {
		s.setErr(err)
		return
	}
	switch b[0] {
	case secStart:
		hdr, err := s.peek(6)
		if err != nil {
			s.setErr(err)
			return
		}
		if hdr[5] != 3 {
			s.fail(reasonDevices)
			return
		}
		full, err := s.peek(6 + 3)
		if err != nil {
			s.setErr(err)
			return
		}
		if string(full[6:]) != "ram" || s.haveRAM {
			s.fail(reasonDevices)
			return
		}
		s.take(1)
		id, _ := s.be32()
		s.str()
		s.be32() // instance
		if v, ok := s.be32(); ok && v != 4 {
			s.fail(fmt.Sprintf("RAM section version %d (4 is known)", v))
			return
		}
		s.ramID, s.haveRAM = id, true
	case secPart, secEnd:
		hdr, err := s.peek(5)
		if err != nil {
			s.setErr(err)
			return
		}
		if !s.haveRAM || binary.BigEndian.Uint32(hdr[1:]) != s.ramID {
			s.fail(reasonDevices)
			return
		}
		s.take(5)
	case secFull, secEOF:
		s.fail(reasonDevices)
		return
	default:
		s.fail(fmt.Sprintf("unknown section type %#x", b[0]))
		return
	}
	s.framing = len(s.cur) > 0
}

// record reads one RAM record, cutting before it when it starts a new
// group of pages.
func (s *Splitter) record() {
	hdr, err := s.peek(8)
	if err != nil {
		s.setErr(err)
		return
	}
	v := binary.BigEndian.Uint64(hdr)
	flags, addr := v&flagMask, v&^uint64(flagMask)
	switch flags &^ flagCont {
	case flagZero, flagPage:
		name := s.curBlock
		if flags&flagCont == 0 {
			n, err := s.peek(9)
			if err != nil {
				s.setErr(err)
				return
			}
			idb, err := s.peek(9 + int(n[8]))
			if err != nil {
				s.setErr(err)
				return
			}
			name = string(idb[9:])
		}
		length, known := s.blocks[name]
		if !known || addr >= length {
			s.fail(fmt.Sprintf("a page of unknown RAM block %q at %#x", name, addr))
			return
		}
		g := int64(addr / GroupBytes)
		if s.framing || ((name != s.curBlock || g != s.group) && len(s.cur) >= MinChunk) {
			s.emit()
		}
		s.curBlock, s.group = name, g
		if _, ok := s.take(8); !ok {
			return
		}
		if flags&flagCont == 0 {
			s.str()
		}
		if flags&^flagCont == flagZero {
			s.take(1)
		} else {
			s.take(pageSize)
		}
		s.pages++
	case flagMemSize:
		if flags&flagCont != 0 || len(s.blocks) > 0 {
			s.fail("a second RAM size record")
			return
		}
		s.take(8)
		total := addr
		for total > 0 {
			name, ok := s.str()
			if !ok {
				return
			}
			n, ok := s.be64()
			if !ok {
				return
			}
			if n > total || n == 0 {
				s.fail("RAM block sizes do not add up")
				return
			}
			s.blocks[name] = n
			total -= n
		}
	case flagEOS:
		if flags != flagEOS || addr != 0 {
			s.fail(fmt.Sprintf("RAM record flags %#x", flags))
			return
		}
		// The end of a section, its footer and the next section's header:
		// a chunk of their own.
		if !s.framing {
			s.emit()
		}
		s.take(8)
		if t, err := s.peek(1); err == nil && t[0] == secFooter {
			s.take(5)
		}
		s.framing = true
		s.section()
	default:
		s.fail(fmt.Sprintf("RAM record flags %#x (compression, XBZRLE or multifd are not expected)", flags))
	}
}
