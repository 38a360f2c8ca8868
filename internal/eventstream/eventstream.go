// Package eventstream owns the server side of a text/event-stream
// response: its headers, sent at once, and writes that are flushed as they
// are made, so each event (or comment) reaches the client when it is
// written. The relay and the scripted model stream through it.
package eventstream

import "net/http"

// Writer writes one event stream.
type Writer struct {
	w  http.ResponseWriter
	rc *http.ResponseController
}

// Start answers 200 with the event-stream headers and flushes them.
func Start(w http.ResponseWriter) *Writer {
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	h.Set("X-Accel-Buffering", "no")
	w.WriteHeader(http.StatusOK)
	s := &Writer{w: w, rc: http.NewResponseController(w)}
	_ = s.rc.Flush()
	return s
}

// Write sends b (whole events) and flushes it.
func (s *Writer) Write(b []byte) error {
	if _, err := s.w.Write(b); err != nil {
		return err
	}
	return s.rc.Flush()
}

// Comment sends an SSE comment line: clients ignore it, it carries no
// content, and it shows the connection is alive.
func (s *Writer) Comment(text string) error {
	return s.Write([]byte(": " + text + "\n\n"))
}
