/*
 * Kiln's JPEG decoding through libjpeg-turbo's libjpeg API (the library
 * Pillow and torchvision ship), with the settings Pillow's decoder uses:
 * ISLOW integer IDCT, fancy (triangle) upsampling, libjpeg's own guess of
 * the file's colour space, and the output colour space Pillow asks for.
 *
 * libjpeg reports errors through error_exit, which must not return; here it
 * longjmps back into the function that called libjpeg, so that no error
 * crosses into Rust as anything but a return code and a message.
 */

#include <setjmp.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "jpeglib.h"
#include "jerror.h"

/* jpeg_simd.c: swaps in SIMD versions of the IDCT, colour conversion and
 * upsampling, bit-exact with libjpeg-turbo's C code, when the CPU has them. */
void kiln_jpeg_use_simd(j_decompress_ptr cinfo);

/* What kiln_jpeg_read_header reports. */
typedef struct {
  unsigned int width;
  unsigned int height;
  int components;   /* in the file: 1, 3 or 4 */
  int color_space;  /* libjpeg's guess: a J_COLOR_SPACE */
  int progressive;
} kiln_jpeg_header;

typedef struct {
  struct jpeg_error_mgr pub;
  jmp_buf jump;
  int truncated;
  char *message;
  size_t message_len;
} kiln_error_mgr;

static void kiln_format(j_common_ptr cinfo) {
  kiln_error_mgr *err = (kiln_error_mgr *)cinfo->err;
  char buffer[JMSG_LENGTH_MAX];
  (*cinfo->err->format_message)(cinfo, buffer);
  if (err->message != NULL && err->message_len > 0) {
    strncpy(err->message, buffer, err->message_len - 1);
    err->message[err->message_len - 1] = '\0';
  }
}

static void kiln_error_exit(j_common_ptr cinfo) {
  kiln_error_mgr *err = (kiln_error_mgr *)cinfo->err;
  kiln_format(cinfo);
  longjmp(err->jump, 1);
}

/* Warnings (level -1) are ignored as Pillow ignores them, except the end
 * of the data: libjpeg then pads the scan with gray, where Pillow refuses
 * the file as truncated. Trace messages (level >= 0) are dropped. */
static void kiln_emit_message(j_common_ptr cinfo, int msg_level) {
  kiln_error_mgr *err = (kiln_error_mgr *)cinfo->err;
  if (msg_level < 0 && cinfo->err->msg_code == JWRN_JPEG_EOF) {
    err->truncated = 1;
    kiln_format(cinfo);
    longjmp(err->jump, 1);
  }
}

static void kiln_init_errors(kiln_error_mgr *err, char *message,
                             size_t message_len) {
  jpeg_std_error(&err->pub);
  err->pub.error_exit = kiln_error_exit;
  err->pub.emit_message = kiln_emit_message;
  err->truncated = 0;
  err->message = message;
  err->message_len = message_len;
  if (message != NULL && message_len > 0) message[0] = '\0';
}

/* Return codes. */
#define KILN_JPEG_OK 0
#define KILN_JPEG_CORRUPT 1
#define KILN_JPEG_TRUNCATED 2
#define KILN_JPEG_BAD_BUFFER 3

int kiln_jpeg_read_header(const unsigned char *data, size_t len,
                          kiln_jpeg_header *header, char *message,
                          size_t message_len) {
  struct jpeg_decompress_struct cinfo;
  kiln_error_mgr err;
  kiln_init_errors(&err, message, message_len);
  cinfo.err = &err.pub;
  jpeg_create_decompress(&cinfo);
  if (setjmp(err.jump)) {
    int code = err.truncated ? KILN_JPEG_TRUNCATED : KILN_JPEG_CORRUPT;
    jpeg_destroy_decompress(&cinfo);
    return code;
  }
  jpeg_mem_src(&cinfo, data, (unsigned long)len);
  jpeg_read_header(&cinfo, TRUE);
  header->width = cinfo.image_width;
  header->height = cinfo.image_height;
  header->components = cinfo.num_components;
  header->color_space = (int)cinfo.jpeg_color_space;
  header->progressive = cinfo.progressive_mode ? 1 : 0;
  jpeg_destroy_decompress(&cinfo);
  return KILN_JPEG_OK;
}

/* Decodes into `out` (height * width * channels bytes, interleaved), where
 * channels is 1 for JCS_GRAYSCALE, 3 for JCS_RGB and 4 for JCS_CMYK, the
 * output colour spaces Pillow asks for ("L", "RGB", "CMYK;I"). */
int kiln_jpeg_decode(const unsigned char *data, size_t len,
                     int out_color_space, unsigned char *out, size_t out_len,
                     char *message, size_t message_len) {
  struct jpeg_decompress_struct cinfo;
  kiln_error_mgr err;
  kiln_init_errors(&err, message, message_len);
  cinfo.err = &err.pub;
  jpeg_create_decompress(&cinfo);
  if (setjmp(err.jump)) {
    int code = err.truncated ? KILN_JPEG_TRUNCATED : KILN_JPEG_CORRUPT;
    jpeg_destroy_decompress(&cinfo);
    return code;
  }
  jpeg_mem_src(&cinfo, data, (unsigned long)len);
  jpeg_read_header(&cinfo, TRUE);
  cinfo.out_color_space = (J_COLOR_SPACE)out_color_space;
  cinfo.dct_method = JDCT_ISLOW;
  cinfo.do_fancy_upsampling = TRUE;
  jpeg_start_decompress(&cinfo);
  kiln_jpeg_use_simd(&cinfo);
  {
    size_t row = (size_t)cinfo.output_width * (size_t)cinfo.output_components;
    if (row * (size_t)cinfo.output_height != out_len) {
      if (message != NULL && message_len > 0) {
        snprintf(message, message_len,
                 "the output buffer holds %lu bytes, the image needs %lu",
                 (unsigned long)out_len,
                 (unsigned long)(row * (size_t)cinfo.output_height));
      }
      jpeg_destroy_decompress(&cinfo);
      return KILN_JPEG_BAD_BUFFER;
    }
    while (cinfo.output_scanline < cinfo.output_height) {
      JSAMPROW rows[16];
      JDIMENSION n = cinfo.output_height - cinfo.output_scanline;
      JDIMENSION i;
      if (n > 16) n = 16;
      for (i = 0; i < n; i++) {
        rows[i] = out + (size_t)(cinfo.output_scanline + i) * row;
      }
      jpeg_read_scanlines(&cinfo, rows, n);
    }
  }
  jpeg_finish_decompress(&cinfo);
  jpeg_destroy_decompress(&cinfo);
  return KILN_JPEG_OK;
}
